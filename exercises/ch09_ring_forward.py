"""Exercise ch09.ring_forward: the forward pass of ring attention, without a causal mask.

Fill in ``ring_attention_forward``, save, then run ``check("ch09.ring_forward")`` in
course/09_long_context.ipynb (or ``make grade``). The checks run it on 2 and 3 ranks, compare
the result with ``scaled_dot_product_attention`` over the whole sequence, and read the
meter: N-1 exchanges of K and V, each to the right-hand neighbour, nothing else.
"""

import math  # noqa: F401  (you will need it)

import torch  # noqa: F401

from engine.comm.ring import exchange, ring_position  # noqa: F401  (and these)
from engine.cp.blocks import block_forward, merge  # noqa: F401


def ring_attention_forward(q, k, v, group=None):
    """Attention of this rank's queries over every rank's keys: the ring, no mask.

    ``q``, ``k``, ``v``: ``(batch, heads, S/N, head_dim)``, this rank's contiguous part of the
    sequence. Return this rank's ``(batch, heads, S/N, head_dim)`` output.

    1. ``me, n, right, left = ring_position(group)``; ``scale = 1 / sqrt(head_dim)``.
    2. Start with ``out = 0`` and ``lse = -inf`` (``torch.full(q.shape[:-1], -inf)``).
    3. N steps: merge ``block_forward(q, k_now, v_now, scale)`` (it returns ``(out, lse)``)
       into the running result with ``merge``; then, except after the last step, pass the
       K/V you hold to the right and take the left neighbour's:
       ``exchange(send, right, recv, left, group)``. Stack K and V into one tensor so one
       exchange carries both.
    """
    raise NotImplementedError("ch09.ring_forward: write me")
