"""One FSDP2 training step: ``engine.fsdp.fully_shard`` (built here from hooks) against PyTorch's
``torch.distributed.fsdp.fully_shard`` on the same tiny GPT, the same ``MixedPrecisionPolicy``
(fp32, and bf16 parameters with fp32 reduction), on 2 and 3 Gloo CPU ranks.

Both shard each transformer block, then the root (embeddings, final LayerNorm), AdamW. After
``--warmup`` steps of each, ``--repeats`` steps are timed, the four variants interleaved and
their order rotated every repeat so that load drift hits all alike; a step's time is the slowest
rank's (barrier before, MAX all-reduce after). Printed: each variant's median step time, the
ratio ours / PyTorch's of the medians and the median of the paired ratios (both from one
run), and the bytes each rank holds (shards, their gradients, AdamW's state) and sends in one
step, counted by :func:`engine.labs.fsdp2.ours_side` (ours, on the wire) and
:func:`engine.labs.fsdp2.torch_side` (PyTorch's, fp32, by the ring formula).

    python benchmarks/fsdp2.py [--ranks 2 3] [--warmup 3] [--repeats 20] [--hidden 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine import launch
from engine.fsdp import MixedPrecisionPolicy, fully_shard
from engine.labs.fsdp2 import ours_side
from engine.labs.fsdp2 import torch_side
from engine.model.gpt import GPTConfig, TinyGPT
from engine.model.data import token_data

POLICIES = {"fp32": (None, None), "bf16/fp32": (torch.bfloat16, torch.float32)}
ROWS = 4  # sequences a rank


def _build(cfg: GPTConfig, which: str, policy):
    gpt = TinyGPT(cfg, seed=0)
    if which == "ours":
        for block in gpt.blocks:
            fully_shard(block, mp_policy=MixedPrecisionPolicy(*policy))
        fully_shard(gpt, mp_policy=MixedPrecisionPolicy(*policy))
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in gpt.blocks:
            torch_fully_shard(block, mesh=mesh, mp_policy=TorchPolicy(*policy))
        torch_fully_shard(gpt, mesh=mesh, mp_policy=TorchPolicy(*policy))
    return gpt, torch.optim.AdamW(gpt.parameters(), lr=1e-3)


def _step(model, optimizer, ids, targets) -> None:
    optimizer.zero_grad()
    logits = model(ids)
    F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1)).backward()
    optimizer.step()


def _run(rank, world_size, cfg: GPTConfig, warmup: int, repeats: int):
    torch.set_num_threads(1)
    ids, targets = token_data(ROWS * world_size, cfg.seq_len, cfg.vocab, seed=1)
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    ids, targets = ids[mine], targets[mine]
    built = {(which, name): _build(cfg, which, policy)
             for name, policy in POLICIES.items() for which in ("ours", "torch")}
    order, times = list(built), {key: [] for key in built}
    for repeat in range(warmup + repeats):
        shift = repeat % len(order)
        for key in order[shift:] + order[:shift]:
            dist.barrier()
            start = time.perf_counter()
            _step(*built[key], ids, targets)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if repeat >= warmup:
                times[key].append(elapsed.item())
    sides = {name: ours_side(cfg, ids, targets, 3, 1e-3, MixedPrecisionPolicy(*policy))
             for name, policy in POLICIES.items()}
    sides["torch fp32"] = torch_side(cfg, ids, targets, 3, 1e-3)
    bytes_ = {name: (s.held.total, s.bytes_sent) for name, s in sides.items()}
    return times, bytes_


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args(argv)
    cfg = GPTConfig(vocab=256, seq_len=args.seq_len, layers=args.layers, heads=4,
                    hidden=args.hidden)
    params = sum(p.numel() for p in TinyGPT(cfg, seed=0).parameters())
    out = {}
    for world_size in args.ranks:
        results = launch(_run, world_size, cfg, args.warmup, args.repeats, backend="gloo",
                         timeout=1800, quiet=True)
        times = results[0][0]
        print(f"\n{world_size} Gloo ranks, tiny GPT ({params / 1e6:.2f} M parameters, "
              f"{args.layers} blocks, h={args.hidden}, s={args.seq_len}, {ROWS} sequences a "
              f"rank), AdamW; median of {args.repeats} interleaved steps after {args.warmup} "
              f"warm-up")
        print(f"{'policy':<11}{'ours ms':>9}{'PyTorch ms':>12}{'ratio of medians':>18}"
              f"{'median of paired ratios':>25}")
        for name in POLICIES:
            ours, theirs = times[("ours", name)], times[("torch", name)]
            ratio = statistics.median(ours) / statistics.median(theirs)
            paired = statistics.median(a / b for a, b in zip(ours, theirs))
            print(f"{name:<11}{statistics.median(ours) * 1e3:>9.1f}"
                  f"{statistics.median(theirs) * 1e3:>12.1f}{ratio:>17.2f}x{paired:>24.2f}x")
            out[(world_size, name)] = ratio
        print(f"{'rank':>4}  " + "".join(f"{name + ' held/sent B':>28}" for name in results[0][1]))
        for rank, (_, bytes_) in enumerate(results):
            print(f"{rank:>4}  " + "".join(f"{f'{h:,} / {s:,}':>28}" for h, s in bytes_.values()))
    return out


if __name__ == "__main__":
    main()
