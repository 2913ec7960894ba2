"""A pipeline schedule is built and checked once per run, not at every step, and the runtime
tells an observer what it does (the timeline and memory counts are the observer's)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from torch import nn

from engine.pp import build_schedule, run_pipeline
from tests.helpers import run_ranks
from tests.test_pp import _train


def _counting(module, name: str, calls: dict):
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return original(*args, **kwargs)

    setattr(module, name, counted)
    return original


def _steps_counted(rank, world_size, kind):
    from engine.pp import registry

    calls: dict = {}
    originals = {name: _counting(registry, name, calls) for name in ("validate", "plan_rounds")}
    try:
        grad_diff, param_diff, _ = _train(rank, world_size, kind, 4, 2, 3)
    finally:
        for name, original in originals.items():
            setattr(registry, name, original)
    return calls, grad_diff, param_diff


def test_three_steps_check_and_plan_the_schedule_once():
    for kind in ("1f1b", "zb_v"):
        for calls, grad_diff, param_diff in run_ranks(_steps_counted, 2, kind):
            assert calls == {"validate": 1, "plan_rounds": 1}, (kind, calls)
            assert grad_diff <= 1e-6 and param_diff <= 1e-6


def _composed_steps_counted(rank, world_size, name):
    from engine.compose.loop import train
    from engine.compose.model import GPT
    from engine.compose.parallelize import parallelize
    from engine.compose.parity import LR, MODEL, ROWS, SEED
    from engine.compose.plan import Plan
    from engine.pp import registry
    from engine.topology import Mesh

    plan = Plan(pp=2, schedule=name, micro_batches=4)
    par = parallelize(GPT(replace(MODEL, layers=4), seed=SEED), Mesh(pp=2), plan,
                      torch.optim.AdamW, lr=LR)
    calls: dict = {}
    originals = {n: _counting(registry, n, calls) for n in ("validate", "plan_rounds")}
    try:
        train(par, 2, ROWS, seed=SEED + 1)
    finally:
        for n, original in originals.items():
            setattr(registry, n, original)
    built = par.pipeline_schedule
    return calls, (built.name, built.p, built.m, built.v, built.placement)


def test_the_composed_engine_builds_the_schedule_when_the_plan_is_applied():
    for name, v, placement in (("zb_h1", 1, "interleaved"), ("interleaved", 2, "interleaved"),
                               ("dualpipe_v", 2, "v")):
        for calls, built in run_ranks(_composed_steps_counted, 2, name):
            # two steps: checked when built (before them), its rounds planned at the first
            assert calls == {"plan_rounds": 1}, (name, calls)
            assert built == (name, 2, 4, v, placement)


class _Log:
    """An observer that keeps the order of what it was told."""

    def __init__(self):
        self.seen = []

    def actions(self, link):
        yield from link.actions()

    @contextmanager
    def _action(self, kind, mb, chunk):
        self.seen.append((kind, mb, chunk))
        yield

    def forward(self, mb, chunk):
        return self._action("F", mb, chunk)

    def backward(self, mb, chunk, stash):
        return self._action("B", mb, chunk)

    def weight_grad(self, mb, chunk):
        return self._action("W", mb, chunk)

    def result(self, loss, p2p_log):
        return self.seen, loss


def _observed(rank, world_size):
    schedule = build_schedule("zb_h1", 2, 3)
    data = [torch.ones(2, 4)] * 3
    seen, loss = run_pipeline([nn.Linear(4, 4)], schedule, data, data, stage=rank,
                              observer=_Log())
    return seen, schedule.actions[rank], loss


def test_the_runtime_tells_its_observer_every_action_in_the_schedule_s_order():
    for rank, (seen, order, loss) in enumerate(run_ranks(_observed, 2)):
        assert [tuple(a) for a in order] == seen
        assert (loss is None) == (rank == 0)


def test_a_placement_that_contradicts_the_built_schedule_is_refused():
    """A built schedule carries its placement; another one passed beside it is an error,
    not silently ignored (before any message is sent)."""
    schedule = build_schedule("zb_v", 2, 4)
    data = [torch.ones(1, 4)] * 4
    with pytest.raises(ValueError, match="placement='interleaved', but the built schedule "
                                         "'zb_v' places its chunks 'v'"):
        run_pipeline([nn.Linear(4, 4), nn.Linear(4, 4)], schedule, data, data, stage=0,
                     placement="interleaved")
