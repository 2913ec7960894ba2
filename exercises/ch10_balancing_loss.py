"""Exercise ch10.balancing_loss: Switch Transformers' auxiliary load-balancing loss.

Fill in ``load_balancing_loss``, save, then run ``check("ch10.balancing_loss")`` in
course/10_moe.ipynb (or ``make grade``). It is checked on router outputs you do not see, for
its value and for its gradient.
"""

import torch  # noqa: F401  (you will need it)


def load_balancing_loss(probs, expert, alpha=0.01):
    """``alpha * E * sum_i f_i * P_i`` (Fedus et al., Switch Transformers, eq. 4).

    ``probs`` [T, E]: the router's softmax for T tokens over E experts.
    ``expert`` [T, k]: the experts each token was routed to (k = 1 in Switch).

    * ``f_i``: the fraction of the ``T * k`` assignments that went to expert i. It is a count:
      no gradient flows through it.
    * ``P_i``: the mean over tokens of ``probs[:, i]``. The gradient flows through it.

    With everything uniform the loss is exactly ``alpha``; any imbalance makes it larger.
    """
    raise NotImplementedError("ch10.balancing_loss: write me")
