"""A dry run (engine.train.dry_run: the fake process group, the model on the meta device)
counts what a real run of the same layout holds and sends: compared rank by rank with the
same step trained on Gloo ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

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


def _real_step(rank, world_size, plan):
    par = parallelize(GPT(LLAMA, seed=0), plan.mesh(), plan, torch.optim.AdamW, lr=1e-4)
    return count_step(par, LLAMA, ROWS)


@pytest.mark.parametrize("name", PLANS)
def test_a_dry_run_counts_what_the_real_run_holds_and_sends(name):
    plan = PLANS[name]
    real = run_ranks(_real_step, plan.world, plan)
    for rank in range(plan.world):
        dry = dataclasses.asdict(count_rank(LLAMA, plan, rank, ROWS))
        assert dry["params"] > 0 and dry["flops"] > 0
        assert {k: dry[k] for k in real[rank]} == real[rank], (name, rank)


def test_one_rank_per_pipeline_stage_is_chosen():
    assert stage_ranks(Plan(dp=2, tp=2, pp=2)) == [0, 4]
    assert stage_ranks(Plan(dp=8, tp=8, pp=4, zero=1)) == [0, 64, 128, 192]
