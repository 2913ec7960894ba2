"""Measurements for chapter 06: real pipeline runs whose timelines give the bubble (and, for
zero-bubble schedules, the split backward's memory), and the stage-imbalance experiment
(uniform cut vs a cut balanced from profiled layer times).

:func:`pipeline_step` drives the same runtime as the composed trainer
(:func:`engine.pp.run_pipeline`, which :func:`engine.compose.pipeline.pipeline_backward`
calls), on a stack of MLP blocks cut anywhere: the chapter measures cuts the trainer's GPT
split cannot make (a balanced cut of unequal blocks), and a stash it can write down
(each block's linear layers' inputs and output gradients)."""

from __future__ import annotations

import time

import torch
from torch import nn

from engine.pp.actions import virtual_stages
from engine.pp.partition import split_model
from engine.pp.registry import SCHEDULES, build_schedule
from engine.pp.runtime import run_pipeline

__all__ = ["SCHEDULES", "schedule_by_name", "mlp_layers", "pipeline_step", "profile_layers"]

schedule_by_name = build_schedule  # the chapter's name for engine.pp.registry.build_schedule


def mlp_layers(widths: list[int], width: int = 512, seed: int = 0) -> nn.Sequential:
    """A stack of blocks ``width -> w -> width`` (Tanh between): a block with a larger ``w``
    costs proportionally more, so ``widths`` sets each layer's cost."""
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(width, w), nn.Tanh(), nn.Linear(w, width), nn.Tanh())
              for w in widths]
    return nn.Sequential(*blocks)


def pipeline_step(rank: int, p: int, kind: str, m: int, starts: list[int], widths: list[int],
                  rows: int = 64, v: int | None = None, repeats: int = 2):
    """Run one training step of schedule ``kind`` (a name of
    :data:`engine.pp.registry.SCHEDULES`) ``repeats`` times (the first warms up) on the model
    cut at ``starts`` (one piece per virtual stage); return the last run's
    :class:`engine.pp.PipelineRun`. The schedule is built and checked once, for every run."""
    schedule = build_schedule(kind, p, m, v)
    layers = mlp_layers(widths)
    pieces = split_model(layers, starts)
    mine = [pieces[i] for i in virtual_stages(rank, p, schedule.v, schedule.placement)]
    width = layers[0][0].in_features
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(rows, width, generator=g) for _ in range(m)]
    ys = [torch.randn(rows, width, generator=g) for _ in range(m)]
    run = None
    for _ in range(repeats):
        for chunk in mine:
            chunk.zero_grad()
        torch.distributed.barrier()
        run = run_pipeline(mine, schedule, xs, ys, stage=rank)
    return run


def profile_layers(widths: list[int], rows: int = 64, repeats: int = 5) -> list[float]:
    """Forward + backward seconds of each layer on one process: the median of ``repeats``
    rounds over all layers, after one untimed round (the first call of a layer pays for
    allocation and warm-up, and would make whichever layer is profiled first look heavy)."""
    layers = mlp_layers(widths)
    x = torch.randn(rows, layers[0][0].in_features)
    samples: list[list[float]] = [[] for _ in layers]
    for round_ in range(repeats + 1):
        for i, layer in enumerate(layers):
            inp = x.clone().requires_grad_()
            start = time.perf_counter()
            layer(inp).sum().backward()
            if round_:
                samples[i].append(time.perf_counter() - start)
    return [sorted(s)[len(s) // 2] for s in samples]
