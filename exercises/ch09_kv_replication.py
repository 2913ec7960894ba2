"""Exercise ch09.kv_replication: Ulysses past the KV heads.

Fill in ``ulysses_gqa_attention``, save, then run ``check("ch09.kv_replication")`` in
course/09_long_context.ipynb (or ``make grade``). The checks run it on 2, 3 and 4 ranks with
grouped-query attention (4 ranks with 2 KV heads, 3 ranks with 2 KV heads: lcm 6), compare the
output with ``scaled_dot_product_attention`` over the whole sequence, read the meter (the KV
heads that travel must be exactly the ones needed: lcm(kv_heads, N) of them, no more), and
ask for a clear error when N does not divide the query heads.
"""

import math  # noqa: F401  (math.lcm)

import torch  # noqa: F401
import torch.distributed as dist  # noqa: F401
import torch.nn.functional as F  # noqa: F401

from engine.cp.ulysses import heads_all_to_all  # noqa: F401  (the all-to-all over heads)


def ulysses_gqa_attention(q, k, v, group=None):
    """Causal attention over the whole sequence for this rank's ``S/N`` tokens, Ulysses-style.

    ``q``: ``(batch, heads, S/N, head_dim)``; ``k``, ``v``: ``(batch, kv_heads, S/N,
    head_dim)`` (contiguous layout: rank r holds tokens r S/N .. (r+1) S/N - 1). N must divide
    ``heads`` (raise ``ValueError`` naming both numbers otherwise); it need not divide
    ``kv_heads``: query head i reads KV head ``i // (heads / kv_heads)``.

    1. ``n = dist.get_world_size(group)``; the KV heads that travel: ``lcm(kv_heads, n)``.
    2. Replicate each KV head ``lcm / kv_heads`` times, adjacent copies together, so that rank
       j's ``lcm / n`` consecutive KV heads are those of its query heads.
    3. ``heads_all_to_all(x, group, 1, 2)`` sends head slice j of ``x`` to rank j and returns
       every rank's tokens of your slice; attend with ``F.scaled_dot_product_attention(...,
       is_causal=True, enable_gqa=True)``; ``heads_all_to_all(out, group, 2, 1)`` goes back.
    """
    raise NotImplementedError("ch09.kv_replication: write me")
