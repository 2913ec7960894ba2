"""Distributed Muon two ways beside single-process Muon and ZeRO-2 AdamW, measured on one rank.

:func:`muon_vs_zero2` trains a bias-free tanh MLP of the given matrix shapes: one step with
:class:`engine.optim.DistributedMuon` (each matrix owned by one rank) under a
:class:`engine.observe.meter.CommMeter` (bytes counted), ``steps`` more; the same with
:class:`engine.optim.GatherMuon` (Moonlight's Algorithm 1: every matrix gathered and
orthogonalised on every rank); and one step of ZeRO-2 AdamW (:class:`engine.zero.ZeroOptimizer`,
stage 2) on the same model and data, metered too. Compare ``params`` and ``gather_params`` with
:func:`single_muon` run on the whole batch for ``steps + 1`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.observe.meter import CommMeter
from engine.optim.distributed import DistributedMuon
from engine.optim.gathered import GatherMuon
from engine.optim.muon import Muon
from engine.zero import ZeroOptimizer

SIZES = ((16, 32), (32, 24), (24, 24), (24, 8))  # (in, out) of each bias-free Linear


def mlp(sizes=SIZES, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = [nn.Linear(i, o, bias=False) for i, o in sizes]
    return nn.Sequential(*[m for layer in layers for m in (layer, nn.Tanh())][:-1])


def data(rows: int, sizes=SIZES, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, sizes[0][0], generator=g), torch.randn(rows, sizes[-1][1],
                                                                    generator=g)


def train(model, step, x, y, steps: int) -> list[torch.Tensor]:
    for _ in range(steps):
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        step()
    return [p.detach().clone() for p in model.parameters()]


def single_muon(steps: int, rows: int = 16, sizes=SIZES, lr: float = 0.02):
    """The parameters after ``steps`` steps of :class:`Muon` on the whole batch."""
    model, (x, y) = mlp(sizes), data(rows, sizes)
    return train(model, Muon(model.parameters(), lr=lr).step, x, y, steps)


@dataclass
class MuonRun:
    params: list[torch.Tensor]  # after steps + 1 steps
    muon_bytes: int  # sent by this rank in one DistributedMuon step, counted
    zero2_bytes: int  # sent by this rank in one ZeRO-2 AdamW step (with its backward), counted
    ns_flops: int  # Newton-Schulz FLOPs this rank ran over all steps, counted
    segment: int  # elements per rank in the collectives (the largest owner's, padded to)
    owned: int  # elements of the matrices this rank owns (and holds momentum for)
    gather_params: list[torch.Tensor]  # GatherMuon's, after steps + 1 steps
    gather_bytes: int  # sent by this rank in one GatherMuon step, counted
    gather_ns_flops: int  # Newton-Schulz FLOPs this rank ran under GatherMuon, all steps
    chunk: int  # GatherMuon's slice: elements per rank in its collectives and its momentum
    steps: int  # steps taken by each optimizer (the metered one included)


def _distributed(optimizer_cls, x, y, steps: int, sizes, lr: float):
    """(the optimizer, its parameters after ``1 + steps`` steps, bytes of the first, counted)."""
    model = mlp(sizes)
    optimizer = optimizer_cls(model.parameters(), lr=lr)
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    with CommMeter() as meter:
        optimizer.step()
    return optimizer, train(model, optimizer.step, x, y, steps), meter.bytes_sent


def muon_vs_zero2(rank: int, world_size: int, steps: int = 3, rows: int = 16, sizes=SIZES,
                  lr: float = 0.02) -> MuonRun:
    x, y = data(rows, sizes)
    mine = slice(rank * rows // world_size, (rank + 1) * rows // world_size)
    optimizer, params, muon_bytes = _distributed(DistributedMuon, x[mine], y[mine], steps,
                                                 sizes, lr)
    gather, gather_params, gather_bytes = _distributed(GatherMuon, x[mine], y[mine], steps,
                                                       sizes, lr)
    adam_model = mlp(sizes)
    zero2 = ZeroOptimizer(adam_model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
    with CommMeter() as adam_meter:
        nn.functional.mse_loss(adam_model(x[mine]), y[mine]).backward()
        zero2.step()
    return MuonRun(params, muon_bytes, adam_meter.bytes_sent, optimizer.ns_flops,
                   optimizer.segment, optimizer.owned_numel, gather_params, gather_bytes,
                   gather.ns_flops, gather.chunk, steps + 1)
