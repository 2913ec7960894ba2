"""engine.train.timed_steps: "allocated once sharded" is read when the optimizer's state exists
(after the first step; AdamW creates its state at its first step), not before it."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from engine.train import timed_steps
from engine.topology import Mesh
from tests.helpers import run_ranks


class _AdamWStrategy:
    """What run_steps needs of a strategy: one AdamW step of a linear layer per step."""

    def __init__(self, mesh: Mesh):
        self.mesh, self.groups, self.device = mesh, {}, torch.device("cpu")
        self.model = nn.Linear(4, 4)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def step(self, k):
        self.optimizer.zero_grad()
        loss = self.model(torch.ones(2, 4)).sum()
        loss.backward()
        self.optimizer.step()
        return SimpleNamespace(loss=loss.item(), events=[])


def _sampled(rank, world_size):
    strategy = _AdamWStrategy(Mesh(dp=world_size))
    seen = []

    def allocated_memory(device):  # a GPU's reading, on the CPU: is the optimizer state there?
        seen.append(len(strategy.optimizer.state))
        return 1234

    original, timed_steps.allocated_memory = timed_steps.allocated_memory, allocated_memory
    try:
        run = timed_steps.run_steps(strategy, steps=2, warmup=1)
    finally:
        timed_steps.allocated_memory = original
    return seen, run.cuda_allocated


def test_memory_once_sharded_is_read_when_the_optimizer_state_exists():
    for seen, allocated in run_ranks(_sampled, 1):
        assert seen == [2]  # read once, with AdamW's state for the weight and the bias
        assert allocated == 1234
