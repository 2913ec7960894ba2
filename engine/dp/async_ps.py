"""Asynchronous SGD through a parameter server: real processes, a staleness knob, a straggler,
and bounded staleness. The counterexample to "asynchronous is always faster (and free)".

Rank 0 is the server; every other rank is a worker. A worker computes a gradient on its copy
of the parameters, sends it to the server, and gets the server's current parameters back. The
server applies each gradient the moment it arrives, from whichever worker sends first (Dean et
al., "Large scale distributed deep networks", NIPS 2012: Downpour SGD). By then other workers
may have moved the parameters on: the gradient is *stale*. The server measures it: staleness =
the number of updates applied between the version a gradient was computed on and its own.

Knobs:

* ``staleness``: a worker adopts the server's parameters only every ``staleness + 1`` steps,
  computing gradients on a copy up to that many of its own steps old (on top of the staleness
  the arrival order creates by itself);
* ``straggler_delay``: rank 1 sleeps this many seconds per step, a slow machine. The fast
  workers race ahead and the straggler's gradients arrive very stale;
* ``bound``: stale synchronous parallel (Ho et al., "More effective distributed ML via a stale
  synchronous parallel parameter server", NIPS 2013). The server holds back its reply to a
  worker that has pushed more than ``bound`` gradients beyond the slowest worker. ``bound=0``
  is lock-step (bulk synchronous); ``None`` is fully asynchronous. Bounded staleness trades
  waiting time for fresher gradients.

The server stops after ``updates`` updates and tells every worker to stop.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from engine.comm import ops
from engine.model.mlp import MLP
from engine.model.data import regression_data, shard

SIZES = (16, 32, 8)
_HEADER = 2  # worker -> server: [clock, version used, grad...]; back: [stop, version, params...]


def _loss_and_grad(model: nn.Module, flat: torch.Tensor, x, y):
    vector_to_parameters(flat, model.parameters())
    model.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.item(), parameters_to_vector(p.grad for p in model.parameters())


def async_sgd(rank: int, world_size: int, updates: int = 120, lr: float = 0.05,
              staleness: int = 0, bound: int | None = None, straggler_delay: float = 0.0,
              batch: int = 16, seed: int = 0):
    """Run on every rank with :func:`engine.launch`.

    The server (rank 0) returns a dict: ``losses`` (full-data loss after each update),
    ``staleness`` (of each applied gradient, in updates), ``pushes`` (gradients applied per
    worker), ``times`` (seconds from the start to each update) and ``seconds`` (wall time).
    Workers return None.
    """
    if world_size < 2:
        raise ValueError(f"async SGD needs a server and at least one worker, got {world_size} "
                         "rank(s)")
    if staleness < 0 or (bound is not None and bound < 0):
        raise ValueError(f"staleness and bound must be >= 0, got {staleness!r} and {bound!r}")
    if updates < 1 or straggler_delay < 0:
        raise ValueError(f"need updates >= 1 and straggler_delay >= 0, got {updates!r} and "
                         f"{straggler_delay!r}")
    model = MLP(SIZES, seed=seed)
    x, y = regression_data(64 * (world_size - 1), SIZES[0], SIZES[-1], seed=seed)
    flat = parameters_to_vector(model.parameters()).detach().clone()
    if rank == 0:
        return _serve(model, flat, x, y, list(range(1, world_size)), updates, lr, bound)
    xs, ys = shard(x, rank - 1, world_size - 1), shard(y, rank - 1, world_size - 1)
    local, version = flat.clone(), 0
    reply = torch.empty(flat.numel() + _HEADER)
    step = 0
    while True:
        start = (step * batch) % xs.size(0)
        _, grad = _loss_and_grad(model, local, xs[start:start + batch], ys[start:start + batch])
        if rank == 1 and straggler_delay:
            time.sleep(straggler_delay)
        step += 1
        ops.send(torch.cat([torch.tensor([float(step), float(version)]), grad]), 0)
        ops.recv(reply, 0)
        if reply[0]:
            return None
        if step % (staleness + 1) == 0:
            local.copy_(reply[_HEADER:])
            version = int(reply[1])


def _serve(model, flat, x, y, workers, updates, lr, bound):
    began = time.perf_counter()
    clocks = {w: 0 for w in workers}
    pushes = {w: 0 for w in workers}
    waiting: list[int] = []  # workers whose reply is held back (bounded staleness)
    message = torch.empty(flat.numel() + _HEADER)
    losses, stale, times = [], [], []

    def reply(worker, stop):
        ops.send(torch.cat([torch.tensor([float(stop), float(len(losses))]), flat]), worker)

    while len(losses) < updates:
        sender = ops.recv(message)  # whichever worker is first
        clocks[sender], used = int(message[0]), int(message[1])
        pushes[sender] += 1
        stale.append(len(losses) - used)
        flat -= lr * message[_HEADER:]
        losses.append(_loss_and_grad(model, flat, x, y)[0])
        times.append(time.perf_counter() - began)
        waiting.append(sender)
        if len(losses) == updates:
            break
        slowest = min(clocks.values())
        for w in list(waiting):
            if bound is None or clocks[w] - slowest <= bound:
                waiting.remove(w)
                reply(w, stop=False)
    for w in waiting:  # held back, or the last sender: nothing more to compute
        reply(w, stop=True)
    for _ in range(len(workers) - len(waiting)):  # still computing: take the gradient, stop
        reply(ops.recv(message), stop=True)
    return {"losses": losses, "staleness": stale, "pushes": pushes, "times": times,
            "seconds": time.perf_counter() - began}
