"""The convergence experiment of chapter 03: the same training run with every compressor.

The task really learns: a random "teacher" network labels Gaussian inputs with one of 10
classes, and a student MLP learns to reproduce the labels (accuracy on held-out inputs).
Every run uses 4 ranks, the same seeds, the same number of steps and momentum SGD; only the
compressor changes. ``CommMeter`` counts the bytes each rank sends for gradients.

Compressors are named by strings (:func:`engine.compress.spec.make_compressor`); the data is
:func:`engine.model.data.teacher_classes`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine.observe.meter import CommMeter
from engine.compress.spec import make_compressor
from engine.dp import DataParallel
from engine.model.data import teacher_classes
from engine.model.mlp import MLP

STUDENT = (32, 256, 256, 10)
RUNS = ("dense", "fp16", "topk:0.1", "topk:0.1:no-ef", "topk:0.01", "topk:0.01:no-ef",
        "topk:0.001", "topk:0.001:no-ef", "powersgd:1", "powersgd:4")


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
    x, y = teacher_classes(batch * world_size * steps, seed=seed + 1)
    test_x, test_y = teacher_classes(2000, seed=seed + 2)
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
