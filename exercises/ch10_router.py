"""Exercise ch10.router: the top-k router with capacity, and its drop mask.

Fill in ``top_k_route``, save, then run ``check("ch10.router")`` in course/10_moe.ipynb (or
``make grade``). It is checked on router logits you do not see, with k = 1, 2 and 3 and
capacity factors from 0.25 (most assignments dropped) to 4 (none).
"""

import math  # noqa: F401  (you will need it)

import torch  # noqa: F401


def top_k_route(logits, top_k, capacity_factor):
    """Route ``T`` tokens from their router logits ``[T, E]``.

    Return ``(expert, gate, keep)``, each ``[T, top_k]``, row t holding token t's choices:

    * ``expert``: the ``top_k`` experts of highest softmax probability, most probable first
      (``torch.topk`` of the probabilities);
    * ``gate``: their probabilities; for ``top_k > 1`` divided by their sum, so a token's
      gates add up to 1 (with ``top_k = 1`` the gate is the probability itself);
    * ``keep``: True where the assignment gets one of its expert's
      ``capacity = ceil(T * top_k * capacity_factor / E)`` slots. Slots are claimed in
      priority order: every token's first choice, in token order, then every second choice in
      token order, and so on. An assignment that finds its expert full is dropped (False).
    """
    raise NotImplementedError("ch10.router: write me")
