"""consolidate_optimizer tells Adam's 0-dim step counter from elementwise state, even when a
bucket's shard holds exactly one element."""

from __future__ import annotations

import torch
from torch import nn

from engine.zero import ZeroOptimizer
from engine.zero.checkpoint import consolidate_optimizer, save_sharded
from tests.helpers import run_ranks


def _save(rank, world_size, directory):
    torch.manual_seed(0)
    model = nn.Linear(1, 1)  # 2 elements: one per rank at dp = 2
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=1, lr=0.1)
    model(torch.ones(3, 1)).sum().backward()
    opt.step()
    save_sharded(directory, model, opt)


def test_a_one_element_shard_keeps_the_step_counter_a_scalar(tmp_path):
    run_ranks(_save, 2, str(tmp_path))
    state = consolidate_optimizer(tmp_path)
    assert set(state.elementwise) == {"exp_avg", "exp_avg_sq"}
    assert {tuple(t.shape) for t in state.elementwise["exp_avg"].values()} == {(1, 1), (1,)}
    assert "step" in state.per_bucket
    assert all(t.dim() == 0 for t in state.per_bucket["step"].values())
