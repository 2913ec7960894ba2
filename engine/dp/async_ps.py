"""Asynchronous SGD through a parameter server: real processes, a staleness knob, and
bounded staleness. The counterexample to "asynchronous is always faster (and free)".

Rank 0 is the server; every other rank is a worker. A worker computes a gradient on its copy
of the parameters, sends it (with its step count) to the server, and gets the server's current
parameters back. The server applies each gradient the moment it arrives, from whichever worker
sends first (Dean et al., "Large scale distributed deep networks", NIPS 2012: Downpour SGD).
By then other workers may have moved the parameters on: the gradient is *stale*.

Knobs:

* ``staleness``: a worker adopts the server's parameters only every ``staleness + 1`` steps,
  computing gradients on a copy up to that many of its own steps old (on top of the staleness
  the arrival order creates by itself);
* ``bound``: stale synchronous parallel (Ho et al., "More effective distributed ML via a stale
  synchronous parallel parameter server", NIPS 2013). The server holds back its reply to a
  worker more than ``bound`` steps ahead of the slowest unfinished worker.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from engine.comm import ops
from engine.models import MLP, regression_data, shard

SIZES = (16, 32, 8)


def _loss_and_grad(model: nn.Module, flat: torch.Tensor, x, y):
    vector_to_parameters(flat, model.parameters())
    model.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.item(), parameters_to_vector(p.grad for p in model.parameters())


def async_sgd(rank: int, world_size: int, steps_per_worker: int = 40, lr: float = 0.05,
              staleness: int = 0, bound: int | None = None, batch: int = 16, seed: int = 0):
    """Run on every rank with :func:`engine.launch`. The server (rank 0) returns the full-data
    loss after each update, in the order the updates were applied; workers return None."""
    if world_size < 2:
        raise ValueError(f"async SGD needs a server and at least one worker, got {world_size} "
                         "rank(s)")
    if staleness < 0 or (bound is not None and bound < 0):
        raise ValueError(f"staleness and bound must be >= 0, got {staleness!r} and {bound!r}")
    model = MLP(SIZES, seed=seed)
    x, y = regression_data(64 * (world_size - 1), SIZES[0], SIZES[-1], seed=seed)
    flat = parameters_to_vector(model.parameters()).detach().clone()
    workers = list(range(1, world_size))
    if rank == 0:
        return _serve(model, flat, x, y, workers, steps_per_worker, lr, bound)
    xs, ys = shard(x, rank - 1, len(workers)), shard(y, rank - 1, len(workers))
    local, reply = flat.clone(), torch.empty_like(flat)
    for step in range(steps_per_worker):
        start = (step * batch) % xs.size(0)
        _, grad = _loss_and_grad(model, local, xs[start:start + batch], ys[start:start + batch])
        ops.send(torch.cat([torch.tensor([step + 1.0]), grad]), 0)
        ops.recv(reply, 0)
        if (step + 1) % (staleness + 1) == 0:
            local.copy_(reply)
    return None


def _serve(model, flat, x, y, workers, steps_per_worker, lr, bound):
    clocks = {w: 0 for w in workers}
    waiting: list[int] = []  # workers whose reply is held back (bounded staleness)
    message = torch.empty(flat.numel() + 1)
    losses = []
    for _ in range(len(workers) * steps_per_worker):
        sender = ops.recv(message)  # whichever worker is first
        clocks[sender] = int(message[0])
        flat -= lr * message[1:]
        losses.append(_loss_and_grad(model, flat, x, y)[0])
        waiting.append(sender)
        running = [c for c in clocks.values() if c < steps_per_worker]
        slowest = min(running) if running else steps_per_worker
        for w in list(waiting):
            if bound is None or clocks[w] - slowest <= bound or clocks[w] >= steps_per_worker:
                ops.send(flat, w)
                waiting.remove(w)
    return losses
