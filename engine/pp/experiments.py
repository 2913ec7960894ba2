"""Measurements for chapter 06: real pipeline runs whose timelines give the bubble, and the
stage-imbalance experiment (uniform cut vs a cut balanced from profiled layer times)."""

from __future__ import annotations

import time

import torch
from torch import nn

from engine.pp.runtime import run_pipeline, split_model
from engine.pp.schedules import gpipe, interleaved_1f1b, one_f_one_b


def mlp_layers(widths: list[int], width: int = 512, seed: int = 0) -> nn.Sequential:
    """A stack of blocks ``width -> w -> width`` (Tanh between): a block with a larger ``w``
    costs proportionally more, so ``widths`` sets each layer's cost."""
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(width, w), nn.Tanh(), nn.Linear(w, width), nn.Tanh())
              for w in widths]
    return nn.Sequential(*blocks)


def _schedule(kind: str, p: int, m: int, v: int = 1):
    if kind == "gpipe":
        return gpipe(p, m)
    if kind == "1f1b":
        return one_f_one_b(p, m)
    return interleaved_1f1b(p, m, v)


def pipeline_step(rank: int, p: int, kind: str, m: int, starts: list[int], widths: list[int],
                  rows: int = 64, v: int = 1, repeats: int = 2):
    """Run one training step ``repeats`` times (the first warms up) on the model cut at
    ``starts`` (``p * v`` pieces); return the last run's :class:`engine.pp.PipelineRun`."""
    layers = mlp_layers(widths)
    pieces = split_model(layers, starts)
    mine = [pieces[c * p + rank] for c in range(v)]
    width = layers[0][0].in_features
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(rows, width, generator=g) for _ in range(m)]
    ys = [torch.randn(rows, width, generator=g) for _ in range(m)]
    run = None
    for _ in range(repeats):
        for chunk in mine:
            chunk.zero_grad()
        torch.distributed.barrier()
        run = run_pipeline(mine, _schedule(kind, p, m, v), xs, ys, stage=rank)
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
