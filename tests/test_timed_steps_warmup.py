"""engine.train.timed_steps: every group the timed steps use has run a built-in collective before
the first timed mark.

NCCL connects a group at its first built-in collective. The first step runs counted on the
wire (point-to-point rings), so without a warm-up of its own each group the steps all-reduce
over would connect inside the first timed step. Checked on Gloo by logging, in order, every
built-in ``torch.distributed`` collective (with the group object it ran on: the world and a
mesh group with the same ranks are two groups, two NCCL communicators) and every clock mark.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from engine.train import timed_steps
from engine.comm import ops
from engine.topology import Mesh
from tests.helpers import run_ranks


class _Strategy:
    """What run_steps needs of a strategy: a data-parallel step over the mesh's dp group."""

    def __init__(self, mesh: Mesh):
        self.mesh, self.groups, self.device = mesh, {}, torch.device("cpu")
        self.weight = torch.ones(4)

    def step(self, k):
        grad = self.weight * (dist.get_rank() + 1)
        ops.all_reduce(grad, group=self.mesh.dp_group)
        ops.all_reduce(grad, group=self.mesh.tp_group)
        return SimpleNamespace(loss=float(grad.sum()), events=[])


def _log_and_run(rank, world_size, warmup):
    log = []
    all_reduce = dist.all_reduce

    def logged_all_reduce(tensor, *args, group=None, **kwargs):
        log.append(("built-in", id(group if group is not None else dist.group.WORLD)))
        return all_reduce(tensor, *args, group=group, **kwargs)

    class LoggedClock(timed_steps.Clock):
        def mark(self):
            log.append(("mark", None))
            return super().mark()

    dist.all_reduce, timed_steps.Clock = logged_all_reduce, LoggedClock
    try:
        run = timed_steps.run_steps(_Strategy(Mesh(dp=world_size)), steps=2,
                                    warmup=warmup)
    finally:
        dist.all_reduce, timed_steps.Clock = all_reduce, timed_steps.Clock.__base__
    return log, len(run.step_s)


@pytest.mark.parametrize("warmup", [1, 0])
def test_each_group_runs_a_built_in_collective_before_the_first_timed_mark(warmup):
    for log, timed in run_ranks(_log_and_run, 2, warmup):
        assert timed == 2
        marks = [i for i, (kind, _) in enumerate(log) if kind == "mark"]
        first_timed = marks[2 * warmup]  # a step's start and end marks; the warm-up's first
        before = {group for kind, group in log[:first_timed] if kind == "built-in"}
        after = {group for kind, group in log[first_timed:] if kind == "built-in"}
        assert after and after <= before, "a group's first built-in collective was timed"
