"""The per-kind formulas of :mod:`engine.compose.formulas`, on one process, against numbers
worked out by hand from the collectives each layer issues (the parity matrix, tests/
test_parity.py, checks the same formulas against the bytes counted on the wire; these are the
bytes it counted per rank for the rows named). The model is the parity matrix's: vocab 64,
seq 16, 2 layers, 4 heads of 8 (2 KV heads), hidden 32; 4 rows a step, 2 micro-batches,
3 steps; t = 2 so that every ring all-reduce sends its payload once, ``2(t-1)/t = 1``."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from engine.compose.formulas import cp_formula, dp_formula, ep_formula, pp_formula, tp_formula
from engine.compose.model import GPT
from engine.compose.parity import MODEL, MOE
from engine.compose.pipeline import apply_pipeline
from engine.compose.plan import Plan
from engine.compose.traffic import report_names

STEPS = 3


def test_tensor_parallel_bytes_per_rank():
    """tp2, b = 2 rows a micro-batch: bsh = 1024 elements. Per micro-batch: 2 layers x 4
    all-reduces of bsh, the embedding's and the output layer's, the loss's 3 of bs = 32."""
    gpt, plan = GPT(MODEL), Plan(tp=2, micro_batches=2)
    per_mb = 2 * 4 * 1024 + 1024 + 1024 + 3 * 32
    assert tp_formula(gpt, plan, 2, STEPS).bytes == STEPS * 2 * per_mb * 4 == 248064
    # sequence parallelism: 15 all-gathers and 10 reduce-scatters of bsh/2, the positions'
    # gather of sh/2, 14 all-reduces of h (10 LayerNorm weights and biases, 4 row biases)
    sp = Plan(tp=2, sequence_parallel=True, micro_batches=2)
    per_mb = 15 * 512 + 10 * 512 + 256 + 14 * 32 + 3 * 32
    assert tp_formula(gpt, sp, 2, STEPS).bytes == STEPS * 2 * per_mb * 4 == 326400
    # MoE layers keep their experts whole: attention's two all-reduces a layer only (b = 1)
    moe = GPT(replace(MODEL, **MOE))
    per_mb = 2 * 2 * 512 + 512 + 512 + 3 * 16
    assert tp_formula(moe, Plan(dp=2, ep=2, tp=2, micro_batches=2), 1, STEPS).bytes == \
        STEPS * 2 * per_mb * 4 == 74880


@pytest.mark.parametrize("method", ["ring-zigzag", "ring-contiguous", "ulysses"])
def test_context_parallel_bytes_per_rank(method):
    """cp2, b = 2, per layer and micro-batch. Ring: one K/V block (2 rows x 8 tokens x 2 KV
    heads x 8, K and V: 512 elements, 2,048 B) forward, K/V and dK/dV backward: 6,144 B.
    Ulysses: the rank's 2 x 8 = 16 tokens of q, k, v (32 + 16 + 16 values) and of the output
    (32), half of it sent, forward and backward: 2 x 16 x 96 x 4 B / 2 = 6,144 B as well."""
    gpt, plan = GPT(MODEL), Plan(cp=2, cp_method=method, micro_batches=2)
    per = 3 * 2048 if method != "ulysses" else 2 * 16 * 96 * 4 // 2
    assert cp_formula(gpt, plan, 2, STEPS).bytes == STEPS * 2 * 2 * per == 73728


@pytest.mark.parametrize("schedule, layers, m, b, sent", [
    ("1f1b", 2, 2, 2, [3 * (2 * 2 * 4096 // 2 + 72) + 3 * 8192,  # rank 0: activations, header
                       3 * 2 * 4096 + 3 * 8192 + 3 * 4]),  # rank 1: gradients, loss broadcast
    ("interleaved", 4, 4, 1, [3 * (3 * 4 * 2048 + 2 * 72) + 3 * 8192,  # 3 boundaries, 2 forward
                              3 * (3 * 4 * 2048 + 72) + 3 * 8192 + 3 * 4]),
    ("zb_v", 4, 4, 1, [3 * (2 * 4 * 2048 + 72) + 3 * 4,  # V: the tied embedding stays on rank 0
                       3 * (2 * 4 * 2048 + 72)]),
])
def test_pipeline_bytes_per_rank(schedule, layers, m, b, sent):
    plan = Plan(pp=2, schedule=schedule, micro_batches=m)
    for rank, expected in enumerate(sent):
        mesh = SimpleNamespace(pp=2, coords=SimpleNamespace(pp=rank))
        gpt = GPT(replace(MODEL, layers=layers))
        apply_pipeline(gpt, mesh, schedule)
        assert pp_formula(gpt, plan, mesh, b, STEPS).bytes == expected, (schedule, rank)


def test_expert_parallel_bytes_take_the_routers_counts():
    """Per micro-batch and MoE layer the counts' all-to-all (4 experts x 8 B, half sent), then
    every row sent to another rank crosses four times (dispatch, combine, and both backward)."""
    gpt, plan = GPT(replace(MODEL, **MOE)), Plan(dp=2, ep=2, micro_batches=2)
    mesh = SimpleNamespace(dp_cp_size=2)
    assert ep_formula(gpt, plan, mesh, None, STEPS, None) is None
    assert ep_formula(gpt, plan, mesh, None, STEPS, 100).bytes == \
        STEPS * 2 * 2 * 16 + 4 * 100 * 32 * 4


def test_data_parallel_bytes_per_rank():
    """dp2 over 103,168 B of parameters: one all-reduce a step (DDP, ZeRO-1), ZeRO-2 a
    reduce-scatter per micro-batch and an all-gather (1.5 all-reduces), + the 4-byte loss."""
    assert dp_formula(103168, 2, 0, STEPS, 2) == dp_formula(103168, 2, 1, STEPS, 2) == \
        STEPS * (103168 + 4) == 309516
    assert dp_formula(103168, 2, 2, STEPS, 2) == STEPS * (1.5 * 103168 + 4) == 464268
    assert dp_formula(103168, 1, 0, STEPS, 2) == 0


def test_engine_train_names_the_gradients_group():
    mesh = SimpleNamespace(dp=1, cp=2, tp=2, pp=1, ep=1, dp_cp_size=2)
    assert report_names({"dp": 10, "cp": 5, "tp": 3, "ep": 0, "pp": 0}, mesh) == \
        {"cp": 15, "tp": 3}
    mesh = SimpleNamespace(dp=2, cp=2, tp=1, pp=1, ep=1, dp_cp_size=4)
    assert report_names({"dp": 10, "cp": 5, "tp": 0, "ep": None, "pp": 0}, mesh) == \
        {"dp x cp": 10, "cp": 5}


def test_expert_gradients_count_as_ep_where_expert_dp_has_the_dp_ranks():
    """MoE dp2 x cp2 x ep2 on 4 ranks (not a parity row): ep borrows the two cp ranks, so the
    experts' gradients are reduced over ``expert_dp_group`` = {0, 2}, the very ranks of
    ``dp_group``. They are expert-parallel bytes (the ep formula holds them): counted under dp,
    as the bookkeeper did, dp sent 2,276,424 B for a formula of 672,840 and ep 190,208 for
    1,793,792 (measured). Every kind, summed over the ranks, must equal its formula."""
    from engine.compose.parity import Row, run_row

    result = run_row(Row(Plan(dp=2, cp=2, ep=2, micro_batches=2), moe=True))
    assert result.holds, result
    for kind in ("dp", "cp", "ep"):
        assert result.sent[kind] > 0 and result.sent[kind] == result.formulas[kind], \
            (kind, result.sent, result.formulas)
    assert result.sent["tp"] == result.sent["pp"] == 0, result.sent
