"""ch09.kv_replication's checks catch the mistakes they aim at (tests/test_grading.py proves
each passes on the solution and fails on the stub)."""

from __future__ import annotations

import math

import torch.distributed as dist
import torch.nn.functional as F

from engine.cp.ulysses import heads_all_to_all
from engine.grading import run_checks


def _ulysses(q, k, v, group, travelling, tile=False, check=True):
    n = dist.get_world_size(group)
    if check and q.shape[1] % n:
        raise ValueError(f"{q.shape[1]} query heads do not split over {n} ranks")
    r = travelling // k.shape[1]
    k, v = ((t.repeat(1, r, 1, 1) if tile else t.repeat_interleave(r, dim=1)) for t in (k, v))
    q, k, v = (heads_all_to_all(t, group, 1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return heads_all_to_all(out, group, 2, 1)


def _every_query_head(q, k, v, group=None):  # right output, but K/V expanded to all heads
    return _ulysses(q, k, v, group, q.shape[1])


def _tiled(q, k, v, group=None):  # right bytes, copies in the wrong order
    return _ulysses(q, k, v, group, math.lcm(k.shape[1], dist.get_world_size(group)), tile=True)


def _silent(q, k, v, group=None):  # right where it can run; no error on a bad degree
    n = dist.get_world_size(group)
    if q.shape[1] % n:
        return q
    return _ulysses(q, k, v, group, math.lcm(k.shape[1], n))


def _failing(impl):
    return {r.name for r in run_checks("ch09.kv_replication", impl=impl).results if not r.passed}


def test_kv_replication_checks_catch_over_replication_wrong_order_and_no_error():
    assert _failing(_every_query_head) == {"sends_only_the_kv_heads_needed"}
    assert _failing(_tiled) == {"equals_attention_past_the_kv_heads"}
    assert _failing(_silent) == {"bad_degree_raises"}
