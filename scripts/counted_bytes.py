"""Counted bytes per rank against the formulas: ZeRO stages 0-3, a TP layer (the one GPT split
by ``parallelize``), Top-K.

Every collective runs inside ``CommMeter(count="wire")``, on the engine's point-to-point
algorithms, so the left column is bytes the ranks actually sent; the right column is
``engine.theory``. Run: ``python scripts/counted_bytes.py`` (about 20 s on 2 cores).
"""

from __future__ import annotations

import torch
from torch import nn

from engine import launch, theory
from engine.observe.meter import CommMeter
from engine.compose.loss import token_losses
from engine.compose.model import GPT, ModelConfig
from engine.compose.parallelize import parallelize
from engine.compose.plan import Plan
from engine.compress import TopK
from engine.dp import DataParallel
from engine.model.mlp import MLP
from engine.model.data import regression_data, token_data
from engine.zero import ZeroDataParallel, ZeroOptimizer

SIZES = (64, 128, 128, 8)  # 25,864 parameters


def zero_step(rank, world_size, stage):
    model = MLP(SIZES, seed=0)
    if stage == 3:
        model = ZeroDataParallel(model, torch.optim.Adam, lr=1e-3)
        opt = model.optimizer
    elif stage == 0:
        model = DataParallel(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        opt = ZeroOptimizer(model.parameters(), torch.optim.Adam, stage=stage, lr=1e-3)
    x, y = regression_data(16, 64, 8, seed=rank)
    with CommMeter() as meter:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return meter.bytes_sent


def tp_layers(rank, world_size, layers, b):
    cfg = ModelConfig(vocab=64, seq_len=16, layers=layers, heads=4, hidden=32)
    plan = Plan(tp=world_size)
    par = parallelize(GPT(cfg, seed=0), plan.mesh(), plan)
    x, y = token_data(b, 16, 64, seed=1)
    with CommMeter() as meter:
        token_losses(par.module(x), y, par.tp_group).mean().backward()
    return meter.bytes_sent


def topk(rank, world_size, numel, ratio):
    torch.manual_seed(rank)
    model = nn.Linear(numel, 1, bias=False)
    ddp = DataParallel(model, compressor=TopK(ratio))
    with CommMeter() as meter:
        model.weight.grad = None
        ddp(torch.randn(2, numel)).sum().backward()
    return meter.bytes_sent


def main() -> None:
    psi = sum(p.numel() for p in MLP(SIZES).parameters())
    print(f"ZeRO, one step of Adam, Ψ = {psi:,} fp32 parameters, bytes sent per rank")
    print(f"{'stage':>5} {'N':>2} {'counted':>10} {'formula':>10}")
    for n in (2, 4):
        for stage in (0, 1, 2, 3):
            sent = launch(zero_step, n, stage, quiet=True)
            formula = 4 * theory.zero_comm_elements(psi, n, stage)
            print(f"{stage:>5} {n:>2} {max(sent):>10,} {formula:>10,.0f}"
                  + ("" if min(sent) == max(sent) else f"  (min {min(sent):,})"))
    b, s, h = 3, 16, 32
    print(f"\nTP, one transformer layer (b = {b}, s = {s}, h = {h}), forward + backward")
    print(f"{'t':>2} {'counted':>10} {'formula':>10}")
    for t in (2, 4):
        one = launch(tp_layers, t, 1, b, quiet=True)[0]
        three = launch(tp_layers, t, 3, b, quiet=True)[0]
        per_layer = (three - one) / 2
        formula = 4 * theory.tp_comm_elements_per_layer(b, s, h, t)
        print(f"{t:>2} {per_layer:>10,.0f} {formula:>10,.0f}")
    numel, ratio = 100_000, 0.01
    print(f"\nTop-K {ratio:.0%} of {numel:,} gradients, values and int32 indices")
    print(f"{'N':>2} {'counted':>10} {'formula':>10} {'dense ring':>11}")
    for n in (2, 4):
        sent = max(launch(topk, n, numel, ratio, quiet=True))
        print(f"{n:>2} {sent:>10,} {theory.topk_bytes_per_rank(numel, ratio, n):>10,.0f} "
              f"{theory.ring_all_reduce_bytes(4 * numel, n):>11,.0f}")


if __name__ == "__main__":
    main()
