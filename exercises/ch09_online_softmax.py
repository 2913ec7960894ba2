"""Exercise ch09.online_softmax: merge the attention of two blocks of keys, exactly.

Fill in ``merge``, save, then run ``check("ch09.online_softmax")`` in
course/09_long_context.ipynb (or ``make grade``). The checks split the keys of a random
attention into blocks, merge the blocks' results with your function, and compare with softmax
attention over all the keys at once; they also start from "no keys seen yet" and feed scores
near 1000, where ``exp`` overflows float32.
"""

import torch  # noqa: F401  (you will need it)


def merge(out_1, lse_1, out_2, lse_2):
    """Combine two blocks' attention results for the same queries into one.

    ``out_j``: ``(..., queries, head_dim)``, block j's softmax-weighted values, normalised
    over block j's keys only. ``lse_j``: ``(..., queries)``, the log-sum-exp of block j's
    scores. Return ``(out, lse)`` for the union of both blocks' keys.

    ``lse_1`` may be ``-inf`` (no keys yet, with ``out_1`` zero): the result is then block 2.
    Never compute ``exp(lse)`` itself: scores of 1000 overflow. ``torch.logaddexp`` and
    ``exp(lse_j - lse)`` stay finite.
    """
    raise NotImplementedError("ch09.online_softmax: write me")
