"""The convergence experiment of chapter 03: the same training run with every compressor.

The task really learns: a random "teacher" network labels Gaussian inputs with one of 10
classes, and a student MLP learns to reproduce the labels (accuracy on held-out inputs).
Every run uses 4 ranks, the same seeds, the same number of steps and momentum SGD; only the
compressor changes. ``CommMeter`` counts the bytes each rank sends for gradients.

Compressors are named by strings so a run is easy to launch and to label:
``"dense"``, ``"fp16"``, ``"bf16"``, ``"topk:0.01"`` (with error feedback),
``"topk:0.01:no-ef"``, ``"randomk:0.01"``, ``"powersgd:4"``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine.observe.meter import CommMeter
from engine.compress.cast import BF16, FP16
from engine.compress.powersgd import PowerSGD
from engine.compress.topk import RandomK, TopK
from engine.dp import DataParallel
from engine.model.mlp import MLP
from engine.model.seed import seeded

STUDENT = (32, 256, 256, 10)
TEACHER = (32, 64, 10)
RUNS = ("dense", "fp16", "topk:0.1", "topk:0.1:no-ef", "topk:0.01", "topk:0.01:no-ef",
        "topk:0.001", "topk:0.001:no-ef", "powersgd:1", "powersgd:4")


def make_compressor(spec: str):
    """The compressor a run's name stands for (``None`` for dense)."""
    kind, *rest = spec.split(":")
    try:
        if kind == "dense" and not rest:
            return None
        if kind in ("fp16", "bf16") and not rest:
            return FP16() if kind == "fp16" else BF16()
        if kind in ("topk", "randomk") and rest and rest[1:] in ([], ["no-ef"]):
            cls = TopK if kind == "topk" else RandomK
            return cls(float(rest[0]), error_feedback=rest[1:] != ["no-ef"])
        if kind == "powersgd" and len(rest) == 1:
            return PowerSGD(int(rest[0]), start_iter=0)  # compress from the first step
    except ValueError as e:
        raise ValueError(f"bad compressor spec {spec!r}: {e}") from None
    raise ValueError(f"unknown compressor spec {spec!r}; expected one like {', '.join(RUNS)}")


def teacher_data(samples: int, seed: int):
    """Inputs and the teacher's labels (the teacher is the same for every seed)."""
    teacher = MLP(TEACHER, seed=1234)
    with seeded(seed), torch.no_grad():
        x = torch.randn(samples, TEACHER[0])
        return x, teacher(x).argmax(dim=1)


def train_compressed(rank: int, world_size: int, spec, steps: int = 300, lr: float = 0.1,
                     batch: int = 32, seed: int = 0, log_every: int = 10) -> dict:
    """One run on every rank (use :func:`engine.launch`). Returns, on every rank: ``losses``
    (training loss over all ranks, averaged over each window of ``log_every`` steps),
    ``accuracy`` and ``test_loss`` (held out, at the end), ``bytes_sent`` (this rank, for
    gradients) and ``dense_bytes`` (what a dense ring all-reduce would send). Every step of a
    run sends the same bytes (the buckets, the ratio and the rank do not change), so the first
    and the last step are counted on the wire, checked equal, and ``bytes_sent`` is that
    count times ``steps``; the other steps run the built-in collectives, about twice as fast. ``spec`` is a
    name (see :func:`make_compressor`) or a function that returns a compressor."""
    compressor = spec() if callable(spec) else make_compressor(spec)
    spec = spec if isinstance(spec, str) else repr(compressor)
    model = DataParallel(MLP(STUDENT, seed=seed), compressor=compressor)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    x, y = teacher_data(batch * world_size * steps, seed=seed + 1)
    test_x, test_y = teacher_data(2000, seed=seed + 2)
    losses, window = [], torch.zeros(2)  # (sum of losses, count)
    counted = []  # bytes counted on the wire in the first and the last step
    for step in range(steps):
        at = (step * world_size + rank) * batch
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[at:at + batch]), y[at:at + batch])
        if step in (0, steps - 1) and len(counted) < 2:
            with CommMeter() as meter:
                loss.backward()
            counted.append(meter.bytes_sent)
        else:
            loss.backward()
        opt.step()
        window += torch.tensor([loss.item(), 1.0])
        if (step + 1) % log_every == 0 or step == steps - 1:
            dist.all_reduce(window)  # for the plot only: not part of training, not metered
            losses.append((step + 1, (window[0] / window[1]).item()))
            window.zero_()
    with torch.no_grad():
        logits = model(test_x)
        accuracy = (logits.argmax(dim=1) == test_y).float().mean().item()
        test_loss = nn.functional.cross_entropy(logits, test_y).item()
    params = sum(p.numel() for p in model.parameters())
    dense = 2 * (world_size - 1) / world_size * params * 4 * steps
    if counted[0] != counted[-1]:
        raise RuntimeError(f"{spec} sent {counted[0]} bytes in its first step and {counted[-1]} "
                           "in its last: its traffic is not the same every step")
    return {"spec": spec, "losses": losses, "accuracy": accuracy, "test_loss": test_loss,
            "bytes_sent": counted[0] * steps, "dense_bytes": dense}
