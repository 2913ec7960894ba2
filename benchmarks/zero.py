"""ZeRO step times in one run (issue 6): stages 0-3 against torch DDP and FSDP, and the effect
of the stage-2 reduce-scatter bucket size (DeepSpeed's ``reduce_bucket_size``).

4 Gloo ranks, an MLP of about 4 M parameters, Adam; each variant's step time is the slowest
rank's, median over the timed steps, variants interleaved so load drift hits all alike.

    python benchmarks/zero.py [--ranks 4] [--steps 8] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from engine import launch
from engine.models import MLP
from engine.zero import ZeroDataParallel, ZeroOptimizer

BUCKETS_MB = (0.25, 1, 4, 16, 64)


def _variants(sizes):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def torch_ddp():
        m = nn.parallel.DistributedDataParallel(MLP(sizes, seed=0))
        return m, torch.optim.Adam(m.parameters(), lr=1e-4)

    def fsdp():
        m = FSDP(MLP(sizes, seed=0), device_id=torch.device("cpu"))
        return m, torch.optim.Adam(m.parameters(), lr=1e-4)

    def zero(stage, cap=25):
        def make():
            m = MLP(sizes, seed=0)
            return m, ZeroOptimizer(m.parameters(), torch.optim.Adam, stage=stage,
                                    bucket_cap_mb=cap, lr=1e-4)
        return make

    def zero3():
        m = ZeroDataParallel(MLP(sizes, seed=0), torch.optim.Adam, lr=1e-4)
        return m, m.optimizer

    variants = {"torch DDP": torch_ddp, "stage 0": zero(0), "stage 1": zero(1),
                "stage 2": zero(2), "stage 3": zero3, "torch FSDP FULL_SHARD": fsdp}
    variants.update({f"stage 2, bucket {mb:g} MB": zero(2, mb) for mb in BUCKETS_MB})
    return variants


def _run(rank, world_size, hidden, steps):
    sizes = (hidden,) * 5 + (8,)
    built = {name: make() for name, make in _variants(sizes).items()}
    x, y = torch.randn(32, hidden), torch.randn(32, 8)
    times = {name: [] for name in built}
    for step in range(steps + 2):
        for name, (model, opt) in built.items():
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step >= 2:
                times[name].append(elapsed.item())
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args(argv)
    result = launch(_run, args.ranks, args.hidden, args.steps)[0]
    params = 4 * args.hidden * args.hidden + 8 * args.hidden
    print(f"{args.ranks} Gloo ranks, MLP with {params / 1e6:.1f} M parameters, Adam, "
          f"median of {args.steps} steps")
    base = result["torch DDP"]
    print(f"{'variant':<26} {'step ms':>8} {'vs torch DDP':>13}")
    for name, t in result.items():
        print(f"{name:<26} {t * 1e3:>8.1f} {t / base:>12.2f}x")
    return result


if __name__ == "__main__":
    main()
