"""A dry run (engine.train.dry_run: the fake process group, the model on the meta device)
counts what a real run of the same layout holds and sends: compared rank by rank with the
same step trained on Gloo ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import theory
from engine.compose.model import GPT, ModelConfig
from engine.compose.parallelize import parallelize
from engine.compose.plan import Plan
from engine.model.presets import MODELS
from engine.train.dry_run import count_rank, count_step, stage_ranks
from tests.helpers import run_ranks

LLAMA = ModelConfig.from_gpt(MODELS["llama-tiny"])
ROWS = 8
PLANS = {"dp2 zero1": Plan(dp=2, zero=1, micro_batches=2),
         "tp2 sp": Plan(tp=2, sequence_parallel=True, micro_batches=2),
         "cp2xdp2 zero3": Plan(cp=2, dp=2, zero=3, micro_batches=2),
         "dp2xpp2 1f1b": Plan(dp=2, pp=2, micro_batches=4),
         "tp2xpp2 zb_h1 zero2": Plan(tp=2, pp=2, zero=2, schedule="zb_h1", micro_batches=4)}


def _real_step(rank, world_size, plan, cfg=LLAMA):
    par = parallelize(GPT(cfg, seed=0), plan.mesh(), plan, torch.optim.AdamW, lr=1e-4)
    return count_step(par, cfg, ROWS)


def _same_counts(plan, cfg=LLAMA):
    real = run_ranks(_real_step, plan.world, plan, cfg)
    for rank in range(plan.world):
        dry = dataclasses.asdict(count_rank(cfg, plan, rank, ROWS))
        assert dry["params"] > 0 and dry["flops"] > 0
        assert {k: dry[k] for k in real[rank]} == real[rank], rank
    return real


@pytest.mark.parametrize("name", PLANS)
def test_a_dry_run_counts_what_the_real_run_holds_and_sends(name):
    _same_counts(PLANS[name])


def test_the_fast_attention_counts_as_a_flash_kernel_on_the_meta_device_too():
    """The fused kernel keeps q, k, v, its output and a log-sum-exp per query for backward,
    on a CPU and (by engine.model.attention's rule) on the meta device: the same bytes and
    FLOPs, and fewer activations than the written-out kernel, which keeps every score."""
    plan = Plan(dp=2, micro_batches=2)
    fast = _same_counts(plan, dataclasses.replace(LLAMA, attention="fast"))
    written = run_ranks(_real_step, 2, plan)
    assert fast[0]["activation_bytes"] < written[0]["activation_bytes"]


def test_one_rank_per_pipeline_stage_is_chosen():
    assert stage_ranks(Plan(dp=2, tp=2, pp=2)) == [0, 4]
    assert stage_ranks(Plan(dp=8, tp=8, pp=4, zero=1)) == [0, 64, 128, 192]


def test_the_trainers_dry_run_prints_each_stages_counts_beside_the_formula(capsys):
    from engine.__main__ import main

    assert main(["train", "--dry-run", "--model", "llama-tiny", "--dp", "2", "--pp", "2",
                 "--zero", "1", "--microbatches", "2"]) == 0
    out = capsys.readouterr().out
    assert "dry run of dp2xpp2 1f1b zero1 on 4 rank(s)" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [row[:2] for row in rows] == [["0", "0"], ["2", "1"]]  # one rank per stage
    plan = Plan(dp=2, pp=2, zero=1, micro_batches=2)
    for row, rank in zip(rows, (0, 2)):
        counted = count_rank(LLAMA, plan, rank, rows=2 * 2 * 4)  # 4-row micro-batches
        assert row[2] == f"{counted.params:,}"
        # ZeRO-1's fp32 AdamW formula; counted adds the buckets' padding and AdamW's step
        # counters (a few bytes a tensor): above it, by under 1%
        formula = theory.zero_model_state_bytes(counted.params, 2, 1, k=8, param_bytes=4,
                                                grad_bytes=4)["total"]
        assert formula <= counted.model_state_bytes <= 1.01 * formula


def test_a_dry_run_refuses_a_bad_layout_before_anything_runs(capsys):
    from engine.__main__ import main

    assert main(["train", "--dry-run", "--model", "llama3-8b", "--tp", "3"]) == 2
    assert "tp = 3 must divide heads = 32" in capsys.readouterr().err
