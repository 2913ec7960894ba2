"""engine.train.timed_steps asks the strategy how to name its bytes: every
:class:`engine.train.steps.Strategy` carries its bookkeeper (``traffic``), the older paths
:func:`engine.train.steps.traffic_by_group` by default, the composed engine
:func:`engine.compose.traffic.strategy_traffic`; the loop has no branch per engine."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.train import timed_steps
from engine.comm import ops
from engine.train.steps import Strategy, traffic_by_group
from engine.topology import Mesh
from tests.helpers import run_ranks


class _Counted:
    """A strategy whose step all-reduces 4 floats over dp and names the bytes itself."""

    def __init__(self, mesh: Mesh):
        self.mesh, self.groups, self.device = mesh, {}, torch.device("cpu")
        self.seen = []

    def step(self, k):
        ops.all_reduce(torch.ones(4), group=self.mesh.dp_group)
        return SimpleNamespace(loss=0.0, events=[])

    def traffic(self, events, mesh, groups):
        self.seen.append((mesh is self.mesh, groups is self.groups))
        return {"mine": sum(e.bytes_sent for e in events)}


def _run(rank, world_size):
    strategy = _Counted(Mesh(dp=world_size))
    run = timed_steps.run_steps(strategy, steps=1, warmup=1)
    return run.traffic, strategy.seen


def test_run_steps_names_the_bytes_with_the_strategys_bookkeeper():
    # a ring all-reduce of 16 B over 2 ranks sends 2(2-1)/2 x 16 = 16 B a rank
    for traffic, seen in run_ranks(_run, 2):
        assert traffic == {"mine": 16}
        assert seen == [(True, True)]  # once, for the counted step, with the mesh and groups


def test_the_older_paths_keep_the_default_bookkeeper():
    """The composed engine's own (strategy_traffic) is what tests/test_train_compose.py's
    reports read: with this default there, they would name dp, tp, pp, embedding instead."""
    strategy = Strategy("x", torch.nn.Linear(1, 1), None, lambda i, l: None, 1, None,
                        torch.device("cpu"))
    assert strategy.traffic is traffic_by_group
    assert timed_steps.traffic_by_group is traffic_by_group  # re-exported: its home before
