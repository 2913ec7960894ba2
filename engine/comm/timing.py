"""Timing all-reduce algorithms on live ranks, the same way everywhere.

Used by ``benchmarks/collectives.py``, chapter 01 and the GPU lab. Each measurement is the
slowest rank's time (a collective is done when its last rank is), the median over repeats,
with the algorithms interleaved inside each repeat so drift in the machine's load hits all of
them alike, in an order reversed every other repeat so none always runs right after another.
Module-level, so it can be started with spawn (NCCL) as well as fork.
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


def time_all_reduces(rank: int, world_size: int, sizes, names=tuple(ALGORITHMS),
                     repeats: int = 5, device: str = "cpu") -> list[tuple[str, int, int, float]]:
    """``[(algorithm, size_bytes, world_size, median_seconds), ...]`` for float32 tensors."""
    return [(name, size, n, statistics.median(times)) for name, size, n, times in
            all_reduce_samples(rank, world_size, sizes, names, repeats, device)]


def all_reduce_samples(rank: int, world_size: int, sizes, names=tuple(ALGORITHMS),
                       repeats: int = 5, device: str = "cpu"
                       ) -> list[tuple[str, int, int, list[float]]]:
    """``[(algorithm, size_bytes, world_size, [seconds of each repeat]), ...]``."""
    unknown = [n for n in names if n not in ALGORITHMS]
    if unknown:
        raise ValueError(f"unknown algorithm(s) {unknown}; expected some of {tuple(ALGORITHMS)}")
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
