"""Reference for ch09.kv_replication (see exercises/ch09_kv_replication.py)."""

import math

import torch.distributed as dist
import torch.nn.functional as F

from engine.cp.ulysses import heads_all_to_all


def ulysses_gqa_attention(q, k, v, group=None):
    n = dist.get_world_size(group)
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % n:
        raise ValueError(f"{heads} query heads do not split over {n} ranks")
    travelling = math.lcm(kv_heads, n)
    k, v = (t.repeat_interleave(travelling // kv_heads, dim=1) for t in (k, v))
    q, k, v = (heads_all_to_all(t, group, 1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return heads_all_to_all(out, group, 2, 1)
