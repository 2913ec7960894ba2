"""Chapter 09's checks catch the mistakes they aim at (tests/test_grading.py proves each passes
on the solution and fails on the stub)."""

from __future__ import annotations

import torch

from engine.comm import ops
from engine.cp.blocks import block_forward, merge
from engine.grading import run_checks


def _naive_merge(out_1, lse_1, out_2, lse_2):  # right algebra, but exp(lse) overflows
    total = torch.exp(lse_1) + torch.exp(lse_2)
    out = (out_1 * torch.exp(lse_1).unsqueeze(-1) + out_2 * torch.exp(lse_2).unsqueeze(-1))
    return out / total.unsqueeze(-1), torch.log(total)


def _average_merge(out_1, lse_1, out_2, lse_2):  # forgets the weights
    return (out_1 + out_2) / 2, torch.maximum(lse_1, lse_2)


def _failing(name, impl):
    return {r.name for r in run_checks(name, impl=impl).results if not r.passed}


def test_online_softmax_checks_catch_overflow_and_missing_weights():
    assert _failing("ch09.online_softmax", _naive_merge) == {"large_scores_stay_finite"}
    assert _failing("ch09.online_softmax", _average_merge) == {
        "two_blocks_give_full_attention", "starts_from_no_keys", "large_scores_stay_finite"}


def _gathering_ring(q, k, v, group=None):  # right answer, but an all-gather, not a ring
    n = torch.distributed.get_world_size()
    whole = torch.empty((n, 2, *k.shape))
    ops.all_gather_into_tensor(whole.view(-1), torch.stack([k, v]).contiguous().view(-1))
    k_all, v_all = (torch.cat(list(whole[:, i]), dim=-2) for i in (0, 1))
    return block_forward(q, k_all, v_all, q.shape[-1] ** -0.5)[0]


def _local_only(q, k, v, group=None):  # never looks beyond its own keys
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"))
    return merge(out, lse, *block_forward(q, k, v, q.shape[-1] ** -0.5))[0]


def test_ring_forward_checks_catch_an_all_gather_and_a_ring_that_never_turns():
    assert _failing("ch09.ring_forward", _gathering_ring) == {"n_minus_1_kv_exchanges"}
    assert _failing("ch09.ring_forward", _local_only) == {"equals_dense_attention",
                                                          "n_minus_1_kv_exchanges"}


def test_zigzag_checks_catch_the_contiguous_layout_and_a_silent_bad_length():
    def contiguous(seq_len, n, rank):
        c = seq_len // n
        return list(range(rank * c, (rank + 1) * c))

    def no_error(seq_len, n, rank):
        c = seq_len // (2 * n)
        return [*range(rank * c, (rank + 1) * c),
                *range((2 * n - 1 - rank) * c, (2 * n - rank) * c)]

    assert _failing("ch09.zigzag_indices", contiguous) == {
        "matches_the_layout", "every_position_once_and_work_balanced", "bad_length_raises"}
    assert _failing("ch09.zigzag_indices", no_error) == {"bad_length_raises"}
