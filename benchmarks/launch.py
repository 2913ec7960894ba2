"""Launch-to-done time: engine.launch (fork) vs torch.multiprocessing.spawn, in one run.

Each run starts N ranks, joins them into a Gloo group, all-reduces one small tensor, tears the
group down and returns. Target (issue 2): fork with 4 ranks in at most 0.5 s.

    python benchmarks/launch.py [--repeats 5] [--spawn-repeats 2] [--sizes 2 4 8]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from engine import launch


def _work(rank, world_size):
    t = torch.ones(16)
    dist.all_reduce(t)
    return float(t[0])


def _spawn_entry(rank, world_size, port):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))
    _work(rank, world_size)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_fork(n: int) -> float:
    start = time.perf_counter()
    assert launch(_work, n, backend="gloo", quiet=True) == [float(n)] * n
    return time.perf_counter() - start


def time_spawn(n: int) -> float:
    start = time.perf_counter()
    tmp.spawn(_spawn_entry, args=(n, _free_port()), nprocs=n, join=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--spawn-repeats", type=int, default=2)
    args = parser.parse_args()

    time_fork(2)  # warm-up: page cache, first fork
    print(f"{os.cpu_count()} CPU cores, torch {torch.__version__}; median seconds "
          f"(fork: {args.repeats} runs, spawn: {args.spawn_repeats})")
    print(f"{'ranks':>5}  {'fork':>8}  {'spawn':>8}  {'spawn/fork':>10}")
    results = {}
    for n in args.sizes:
        fork = statistics.median(time_fork(n) for _ in range(args.repeats))
        spawn = statistics.median(time_spawn(n) for _ in range(args.spawn_repeats))
        results[n] = fork
        print(f"{n:>5}  {fork:>8.3f}  {spawn:>8.2f}  {spawn / fork:>9.0f}x", flush=True)
    if 4 in results:
        verdict = "met" if results[4] <= 0.5 else "MISSED"
        print(f"target fork(4 ranks) <= 0.5 s: {results[4]:.3f} s, {verdict}")


if __name__ == "__main__":
    main()
