"""Exercise ch10.aux_free_bias: DeepSeek-V3's auxiliary-loss-free balancing.

Fill in ``biased_top_k`` and ``update_bias``, save, then run ``check("ch10.aux_free_bias")`` in
course/10_moe.ipynb (or ``make grade``). The checks run them on router probabilities and
loads you do not see: the experts chosen, the gates (values and gradient), and the biases after
an update, including experts exactly at the mean load.

Each expert i has a bias b_i. It is added to the router's scores only to choose the top-k
experts; the gates that weight the experts' outputs come from the scores **without** the bias,
so no gradient ever reaches it (DeepSeek-V3 technical report, section 2.1.2).
"""

import torch  # noqa: F401  (you will need it)


def biased_top_k(probs, bias, top_k):
    """``probs`` [T, E]: the router's softmax (it may require grad); ``bias`` [E].

    Return ``(expert, gate)``, both [T, top_k]: each token's top_k experts by ``probs + bias``,
    most preferred first, and their gates from the unbiased ``probs``: the k probabilities
    divided by their sum when top_k > 1, the probability itself when top_k = 1 (as
    ch10.router). The gates must be differentiable with respect to ``probs``.
    """
    raise NotImplementedError("ch10.aux_free_bias: write me")


def update_bias(bias, load, gamma):
    """``load`` [E]: the assignments each expert received in the step. Return the new
    biases: every bias moves by ``gamma`` towards balance, down for an expert above the mean
    load, up for one below, unchanged for one exactly at the mean."""
    raise NotImplementedError("ch10.aux_free_bias: write me")
