"""The formulas the drill asks for, each checked against the theory it follows from, not
against itself: a crossover is where two counts meet, a break-even where two byte counts do."""

from __future__ import annotations

import pytest

from engine import theory


@pytest.mark.parametrize("h", [1024, 4096, 8192])
@pytest.mark.parametrize("t", [2, 4, 8])
def test_at_the_crossover_tensor_parallelism_and_zero3_send_the_same(h, t):
    tokens = theory.tp_zero3_crossover_tokens(h)
    tp = theory.tp_comm_elements_per_layer(1, tokens, h, t)
    assert tp == pytest.approx(theory.zero3_comm_elements_per_layer(h, t), rel=1e-12)
    assert theory.tp_comm_elements_per_layer(1, tokens * 1.01, h, t) > \
        theory.zero3_comm_elements_per_layer(h, t)


@pytest.mark.parametrize("n", [2, 4, 8, 32])
def test_at_the_break_even_ratio_top_k_sends_what_the_ring_sends(n):
    numel = 1_000_000
    ratio = theory.topk_breakeven_ratio(n)
    ring = theory.ring_all_reduce_bytes(4 * numel, n)
    assert theory.topk_bytes_per_rank(numel, ratio, n) == pytest.approx(ring, rel=1e-3)
    assert theory.topk_bytes_per_rank(numel, 2 * ratio, n) > ring
    assert theory.topk_breakeven_ratio(n, value_bytes=2, index_bytes=2) == 2 * ratio


@pytest.mark.parametrize("n", [1, 8, 16])
def test_offload_moves_a_gpus_fp16_gradient_and_parameter_shards(n):
    held = theory.zero_model_state_bytes(7e9, n, stage=3)  # 2 + 2 bytes a parameter, sharded
    assert theory.offload_pcie_bytes(7e9, n) == held["params"] + held["grads"]
    with pytest.raises(ValueError, match="n"):
        theory.offload_pcie_bytes(7e9, 0)
