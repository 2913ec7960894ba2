"""Timing all-reduce algorithms on live ranks, the same way everywhere.

Used by ``benchmarks/collectives.py``, chapter 01 and the GPU lab. Each measurement is the
slowest rank's time (a collective is done when its last rank is), the median over repeats,
with the algorithms interleaved inside each repeat so drift in the machine's load hits all of
them alike, in an order reversed every other repeat so none always runs right after another.
Module-level, so it can be started with spawn (NCCL) as well as fork. The times are the host's
clock around the call, after a barrier and a device synchronisation on each side: the whole
collective as the caller waits for it (a :class:`engine.observe.meter.CommMeter` on NCCL reports NCCL's
own timing of each op instead, labelled ``timed_by="nccl"``: :mod:`engine.observe.durations`).

By default every algorithm the group's backend can run is timed, on the rank's device
(:func:`engine.launch.device.rank_device`: its GPU on NCCL, else the CPU): on NCCL that is all but the
tuned ring, which posts receives ahead of their sends and could block there
(:data:`NOT_ON_NCCL`).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from engine.comm.ps import ps_all_reduce
from engine.comm.ring import ring_all_reduce
from engine.comm.ring_pipelined import RingBuffers, ring_all_reduce_pipelined
from engine.comm.tree import tree_all_reduce

# name -> fn(tensor, buffers): ``buffers`` is one RingBuffers per timing call, which the tuned
# ring reuses between repeats as a long-running job would.
ALGORITHMS = {
    "built-in": lambda t, buffers: dist.all_reduce(t),
    "ring": lambda t, buffers: ring_all_reduce(t, check=False),
    "ring-tuned": lambda t, buffers: ring_all_reduce_pipelined(t, check=False, buffers=buffers),
    "tree": lambda t, buffers: tree_all_reduce(t, check=False),
    "ps": lambda t, buffers: ps_all_reduce(t, check=False),
}
# the algorithms NCCL cannot run, and why (the tuned ring refuses NCCL itself)
NOT_ON_NCCL = {"ring-tuned": "it posts receives ahead of their sends, which can block on NCCL"}


def default_algorithms(group=None) -> tuple[str, ...]:
    """Every algorithm of :data:`ALGORITHMS` that ``group``'s backend can run."""
    nccl = dist.get_backend(group) == "nccl"
    return tuple(name for name in ALGORITHMS if not (nccl and name in NOT_ON_NCCL))


def time_all_reduces(rank: int, world_size: int, sizes, names=None, repeats: int = 5,
                     device: str | None = None) -> list[tuple[str, int, int, float]]:
    """``[(algorithm, size_bytes, world_size, median_seconds), ...]`` for float32 tensors.

    ``names``: the algorithms to time (default: :func:`default_algorithms`); ``device``: where
    the tensors live (default: the rank's device)."""
    return [(name, size, n, statistics.median(times)) for name, size, n, times in
            all_reduce_samples(rank, world_size, sizes, names, repeats, device)]


def all_reduce_samples(rank: int, world_size: int, sizes, names=None, repeats: int = 5,
                       device: str | None = None) -> list[tuple[str, int, int, list[float]]]:
    """``[(algorithm, size_bytes, world_size, [seconds of each repeat]), ...]``."""
    names = default_algorithms() if names is None else tuple(names)
    unknown = [n for n in names if n not in ALGORITHMS]
    if unknown:
        raise ValueError(f"unknown algorithm(s) {unknown}; expected some of {tuple(ALGORITHMS)}")
    refused = [n for n in names if n in NOT_ON_NCCL and dist.get_backend() == "nccl"]
    if refused:
        raise ValueError(f"{refused[0]!r} cannot run on NCCL: {NOT_ON_NCCL[refused[0]]}; "
                         f"time some of {default_algorithms()} there")
    if device is None:
        from engine.launch.device import rank_device

        device = str(rank_device())
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    rows, buffers = [], RingBuffers()
    for size in sizes:
        t = torch.ones(size // 4, device=device)
        times: dict[str, list[float]] = {name: [] for name in names}
        for name in names:
            ALGORITHMS[name](t, buffers)  # warm-up: connections, buffers
        for repeat in range(repeats):
            for name in (names if repeat % 2 == 0 else names[::-1]):
                dist.barrier()
                _sync(device)
                start = time.perf_counter()
                ALGORITHMS[name](t, buffers)
                _sync(device)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64,
                                       device=device)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times[name].append(elapsed.item())
        rows += [(name, size, world_size, ts) for name, ts in times.items()]
    return rows


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
