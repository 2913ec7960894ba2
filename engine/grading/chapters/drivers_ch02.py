"""Chapter 02's drivers: what runs in the grading worker, next to the learner's code.

Each ``..._on_rank`` function here is a rank's body for :func:`engine.grading.core.run_ranks`:
it runs in the ranks the grading worker starts, with the learner's function among its
arguments, builds what that function needs (the model, the optimizer, the data shard, the
meter) and returns only what it observed (parameters, optimizer moments, the meter's events,
times) as plain data. No comparison and no reference belongs here: a submission can patch
anything in the worker, so every verdict is computed in the grader, in
:mod:`engine.grading.chapters.ch02`, which also runs the references (one process on the full
batch, the engine's DataParallel) in ranks without the learner's code. The models, optimizers
and data shared by both sides are defined here, once.

This module's name does not start with "ch", so :mod:`engine.grading.chapters` does not take
it for a chapter.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from engine.observe.meter import CommMeter
from engine.dp import DataParallel
from engine.model.mlp import MLP
from engine.model.data import regression_data, shard
from engine.model.seed import seeded

SIZES = (16, 32, 8)
DDP_SIZES = (16, 32, 32, 8)  # 1864 fp32 parameters, 7456 bytes


def copied_params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def momentum_sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def accumulate_on_rank(rank, world_size, impl, k):
    """A driver: the learner's accumulation step, twice; the parameters it left, the number of
    collectives the meter saw and the last loss it returned."""
    x, y = regression_data(6 * k * world_size, 16, 8, seed=11)
    model = DataParallel(MLP(SIZES, seed=2), bucket_cap_mb=1.0)  # one bucket
    opt = momentum_sgd(model.parameters())  # scale-sensitive
    xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
    micro = [(a.clone(), b.clone()) for a, b in zip(xs.chunk(k), ys.chunk(k), strict=True)]
    with CommMeter() as meter:
        for _ in range(2):
            loss = impl(model, opt, micro)
    return copied_params(model.module), len(meter.events), loss


def make_optimizer(kind, params):
    if kind == "sgd":  # momentum SGD is linear in the gradient: it notices a sum for a mean
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-2)  # Adam's state notices averaged parameters


def averaging_on_rank(rank, world_size, impl, kind="adam"):
    """A driver: 3 steps with the learner's averaging between backward and step; the
    parameters, the optimizer's first moments and the number of collectives it issued."""
    x, y = regression_data(8 * world_size, 16, 8, seed=4)
    model = MLP(SIZES, seed=2)
    opt = make_optimizer(kind, model.parameters())
    xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
    with CommMeter() as meter:
        for _ in range(3):
            opt.zero_grad()
            nn.functional.mse_loss(model(xs), ys).backward()
            impl(model)
            opt.step()
    state = "exp_avg" if kind == "adam" else "momentum_buffer"
    moments = torch.cat([s[state].flatten() for s in opt.state.values()])
    return copied_params(model), moments, len(meter.events)


# -- ch02.bucketed_ddp ------------------------------------------------------------------------

def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def bucketed_on_rank(rank, world_size, impl, cap_mb):
    """A driver: 3 AdamW steps of the learner's class; the parameters it left, the meter's
    events of each backward, and when the last gradient became ready in the last one."""
    x, y = regression_data(4 * world_size, 16, 8, seed=5)
    model = impl(MLP(DDP_SIZES, seed=3 + rank), bucket_cap_mb=cap_mb)  # differ until broadcast
    opt = adamw(model.module.parameters())
    xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
    grads_done: list[float] = []  # when each gradient became ready, in the last backward
    for p in model.module.parameters():
        p.register_post_accumulate_grad_hook(lambda _p: grads_done.append(time.perf_counter()))
    steps = []
    for _ in range(3):
        grads_done.clear()
        opt.zero_grad()
        with CommMeter() as meter:
            nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()
        steps.append([(e.op, e.payload_bytes, e.start) for e in meter.events])
    return copied_params(model.module), steps, max(grads_done)


# -- ch02.overlap_hook ------------------------------------------------------------------------

class Detour(nn.Module):
    """Declares layers a, b, c but runs a, c, b: in backward b's gradients arrive first, though
    its bucket is not the first, so a hook that launches buckets as they complete launches
    them out of order."""

    def __init__(self, seed: int):
        super().__init__()
        with seeded(seed):
            self.a, self.b, self.c = nn.Linear(16, 24), nn.Linear(20, 8), nn.Linear(24, 20)

    def forward(self, x):
        return self.b(torch.tanh(self.c(torch.tanh(self.a(x)))))


def overlap_model(name: str, seed: int) -> nn.Module:
    return MLP(DDP_SIZES, seed=seed) if name == "mlp" else Detour(seed)


class HookedDataParallel(DataParallel):
    """The engine's DataParallel with the learner's hook in place of its own."""

    def __init__(self, module, hook, **kwargs):
        super().__init__(module, **kwargs)
        self.hook = hook

    def _on_grad_ready(self, p):
        if self._sync:
            self.launcher.end.queue()  # the end of backward waits and averages
            self.hook(p, self.buckets, self.launcher.bucket_of, self._launch)


def overlap_batch(rank, world_size):
    x, y = regression_data(4 * world_size, 16, 8, seed=7)
    return shard(x, rank, world_size), shard(y, rank, world_size)


def overlap_on_rank(rank, world_size, hook, model_name, cap_mb):
    """A driver: the engine's DataParallel with the learner's hook; its gradients after each
    backward, when backward ended and the meter's events."""
    xs, ys = overlap_batch(rank, world_size)
    ours = HookedDataParallel(overlap_model(model_name, 3), hook, bucket_cap_mb=cap_mb)
    opt = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
    steps = []
    for _ in range(3):
        opt.zero_grad()
        with CommMeter() as meter:
            nn.functional.mse_loss(ours(xs), ys).backward()
        steps.append(dict(grads=[None if p.grad is None else p.grad.clone()
                                 for p in ours.parameters()],
                          backward_end=ours.backward_done_at,
                          events=[(e.op, e.payload_bytes, e.start) for e in meter.events]))
        opt.step()
    return steps
