"""ZeRO step times in one run: stages 0-3 against PyTorch's own implementation of each, and the
effect of the stage-2 reduce-scatter bucket size (DeepSpeed's ``reduce_bucket_size``).

"stage 1 tuned" and "stage 2 tuned" are ``TunedZeroOptimizer``: the same optimizer with its
step's reduce-scatter and all-gather on the engine's pipelined ring instead of Gloo's built-ins.
Each stage's PyTorch counterpart: stage 0 DDP; stage 1 DDP + ``ZeroRedundancyOptimizer``;
stage 2 FSDP2 ``fully_shard(reshard_after_forward=False)``; stage 3 FSDP2 ``fully_shard`` (and
FSDP1 ``FULL_SHARD``), FSDP2 on every ``Linear``, as the engine's ZeRO-3 units.

4 Gloo ranks, an MLP of about 4 M parameters, Adam; each variant's step time is the slowest
rank's, median over the timed steps, variants interleaved so load drift hits all alike.

    python benchmarks/zero.py [--ranks 4] [--steps 8] [--hidden 1024] [--no-buckets]
                              [--trace DIR]

``--trace DIR`` also profiles one more step of each stage and its counterpart with
``torch.profiler`` and writes rank 0's Chrome trace per variant (open it in Perfetto or
chrome://tracing), then prints where rank 0's time went in each: the ops that took longest.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from engine import launch
from engine.model.mlp import MLP
from engine.zero import TunedZeroOptimizer, ZeroDataParallel, ZeroOptimizer

BUCKETS_MB = (0.25, 1, 4, 16, 64)
# Adam's implementation, given to every variant alike. On the CPU PyTorch's default is the
# single-tensor loop, whose speed depends on how the elements are cut into tensors: measured
# here, one flat 4.2 M-element tensor (ZeRO's bucket) steps 2.8x slower than the same elements
# as the MLP's ten tensors, while the foreach and fused kernels take the same time for both.
# The default would time the layout of the optimizer's input, not ZeRO.
ADAM = {"foreach": {"foreach": True}, "fused": {"fused": True}, "default": {}}


def _variants(sizes, buckets=True, adam=None):
    adam = adam or {}
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def torch_ddp():
        m = nn.parallel.DistributedDataParallel(MLP(sizes, seed=0))
        return m, torch.optim.Adam(m.parameters(), lr=1e-4, **adam)

    def fsdp():
        m = FSDP(MLP(sizes, seed=0), device_id=torch.device("cpu"))
        return m, torch.optim.Adam(m.parameters(), lr=1e-4, **adam)

    def zero(stage, cap=25, optimizer=ZeroOptimizer):
        def make():
            m = MLP(sizes, seed=0)
            return m, optimizer(m.parameters(), torch.optim.Adam, stage=stage,
                                bucket_cap_mb=cap, lr=1e-4, **adam)
        return make

    def zero3():
        m = ZeroDataParallel(MLP(sizes, seed=0), torch.optim.Adam, lr=1e-4, **adam)
        return m, m.optimizer

    def torch_zero1():
        from torch.distributed.optim import ZeroRedundancyOptimizer

        m = nn.parallel.DistributedDataParallel(MLP(sizes, seed=0))
        return m, ZeroRedundancyOptimizer(m.parameters(), torch.optim.Adam, lr=1e-4, **adam)

    def fsdp2(reshard_after_forward):
        def make():
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            m = MLP(sizes, seed=0)
            for layer in m.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
            fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward)
            return m, torch.optim.Adam(m.parameters(), lr=1e-4, **adam)
        return make

    variants = {"torch DDP": torch_ddp, "stage 0": zero(0), "stage 1": zero(1),
                "stage 1 tuned": zero(1, optimizer=TunedZeroOptimizer),
                "torch DDP + ZeRO-Opt": torch_zero1, "stage 2": zero(2),
                "stage 2 tuned": zero(2, optimizer=TunedZeroOptimizer),
                "torch FSDP2 no reshard": fsdp2(False), "stage 3": zero3,
                "torch FSDP2": fsdp2(True), "torch FSDP FULL_SHARD": fsdp}
    if buckets:
        variants.update({f"stage 2, bucket {mb:g} MB": zero(2, mb) for mb in BUCKETS_MB})
    return variants


# each stage and the PyTorch implementation it is compared with
COUNTERPARTS = {"stage 0": "torch DDP", "stage 1": "torch DDP + ZeRO-Opt",
                "stage 1 tuned": "torch DDP + ZeRO-Opt", "stage 2": "torch FSDP2 no reshard",
                "stage 2 tuned": "torch FSDP2 no reshard", "stage 3": "torch FSDP2"}


def _step(model, opt, x, y) -> None:
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _run(rank, world_size, hidden, steps, buckets=True, adam=None, trace_dir=None):
    sizes = (hidden,) * 5 + (8,)
    built = {name: make() for name, make in _variants(sizes, buckets, adam).items()}
    x, y = torch.randn(32, hidden), torch.randn(32, 8)
    times = {name: [] for name in built}
    for step in range(steps + 2):
        for name, (model, opt) in built.items():
            dist.barrier()
            start = time.perf_counter()
            _step(model, opt, x, y)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step >= 2:
                times[name].append(elapsed.item())
    result = {name: statistics.median(ts) for name, ts in times.items()}
    if trace_dir is None:
        return result, {}
    return result, _profile(rank, built, x, y, trace_dir)


def _profile(rank, built, x, y, trace_dir, top=6):
    """One more step of each compared variant under ``torch.profiler`` on every rank; rank 0
    writes its Chrome trace and returns its longest ops (self CPU time, ms) per variant."""
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    Path(trace_dir).mkdir(parents=True, exist_ok=True)
    longest = {}
    for name in dict.fromkeys(n for pair in COUNTERPARTS.items() for n in pair):  # in order, once
        model, opt = built[name]
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _step(model, opt, x, y)
        if rank == 0:
            prof.export_chrome_trace(str(Path(trace_dir) / f"{name.replace(' ', '_')}.json"))
            rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total,
                          reverse=True)[:top]
            longest[name] = [(e.key, e.self_cpu_time_total / 1e3) for e in rows]
    return longest


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--no-buckets", action="store_true",
                        help="skip the stage-2 bucket-size variants")
    parser.add_argument("--adam", default="foreach", choices=ADAM,
                        help="Adam's implementation, the same for every variant (default: "
                             "%(default)s)")
    parser.add_argument("--trace", metavar="DIR",
                        help="also write rank 0's Chrome trace of one step of each compared "
                             "variant into DIR and print its longest ops")
    args = parser.parse_args(argv)
    result, longest = launch(_run, args.ranks, args.hidden, args.steps, not args.no_buckets,
                             ADAM[args.adam], args.trace, timeout=1800)[0]
    params = 4 * args.hidden * args.hidden + 8 * args.hidden
    print(f"{args.ranks} Gloo ranks, MLP with {params / 1e6:.1f} M parameters, Adam "
          f"({args.adam}), "
          f"median of {args.steps} steps")
    base = result["torch DDP"]
    print(f"{'variant':<26} {'step ms':>8} {'vs torch DDP':>13}")
    for name, t in result.items():
        print(f"{name:<26} {t * 1e3:>8.1f} {t / base:>12.2f}x")
    print("\neach stage against PyTorch's implementation of it:")
    for ours, theirs in COUNTERPARTS.items():
        print(f"  {ours} / {theirs}: {result[ours] / result[theirs]:.2f}x")
    if longest:
        print(f"\nrank 0's longest ops in one profiled step (self CPU ms; traces in {args.trace}):")
        for name, rows in longest.items():
            print(f"  {name}: " + ", ".join(f"{op} {ms:.1f}" for op, ms in rows))
    return result


if __name__ == "__main__":
    main()
