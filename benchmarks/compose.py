"""The composed engine's speed: one training step of dp2 x tp2 with ZeRO-3 (FSDP + TP, the
"2D" layout torchtitan trains with by default) against PyTorch's own composition of the same
model, and the tokens per second of every row of the parity matrix.

PyTorch's side is torchtitan's recipe on the same :class:`engine.compose.model.GPT`: an
``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``, DTensor
``parallelize_module`` over ``tp`` (the embedding row-wise, i.e. vocab-parallel; each fused
``[q | k | v]`` and each ``fc`` column-wise, each attention ``proj`` and MLP ``out``
row-wise; the output layer column-wise with its logits left sharded and the cross-entropy
under ``loss_parallel``, as Megatron's vocab-parallel one), then FSDP2 ``fully_shard`` on
every block and on the root over ``dp``. The fused ``[q | k | v]`` rows are reordered first
so that a contiguous column shard is one rank's query, key and value heads (what
:func:`engine.compose.parallelize.parallel_qkv` takes). The engine's side is
``parallelize(GPT, Mesh(dp=2, tp=2), Plan(dp=2, tp=2, zero=3))`` and its one training step.
Both untied (DTensor cannot tie a row-sharded embedding to a column-sharded head), AdamW,
fp32, Gloo on CPU; each step time is the slowest rank's, the ratio the median over the timed
steps, both variants in the same run, interleaved step by step so load drift hits both alike.

    python benchmarks/compose.py [--steps 8] [--warmup 2] [--no-rows] [--only TEXT]

The second table trains each parity row's layout (:mod:`engine.compose.parity`: its tiny
model and global batch) for ``--steps`` steps after warm-up and reports tokens (of the global
batch, padding included) per second of the median step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine import launch
from engine.model.data import global_batch
from engine.compose.data import rank_slice
from engine.compose.loop import train_step
from engine.compose.model import GPT, ModelConfig
from engine.compose.parallelize import parallelize, qkv_heads_slice
from engine.compose.parity import ALL_ROWS, LR, ROWS, SEED, Row, model_config
from engine.compose.plan import Plan

BENCH = ModelConfig(vocab=2048, seq_len=128, layers=4, heads=8, hidden=256, kv_heads=4,
                    qkv_bias=False, tied=False)
BENCH_ROWS = 8  # sequences in the global batch


def torch_2d(cfg: ModelConfig, dp: int, tp: int):
    """The same GPT under PyTorch's FSDP2 x DTensor TP (module docstring)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = GPT(cfg, seed=SEED)
    d = cfg.head_dim
    sizes = [cfg.heads * d, cfg.kv_heads_or_heads * d, cfg.kv_heads_or_heads * d]
    for block in model.blocks:  # rank r's [q_r | k_r | v_r] contiguous
        w = block.attn.qkv.weight
        with torch.no_grad():
            w.copy_(torch.cat([qkv_heads_slice(w, sizes, tp, r) for r in range(tp)]))
        parallelize_module(block, mesh["tp"], {"attn.qkv": ColwiseParallel(),
                                               "attn.proj": RowwiseParallel(),
                                               "fc": ColwiseParallel(),
                                               "out": RowwiseParallel()})
        block.attn.heads //= tp
        block.attn.kv_heads //= tp
    parallelize_module(model, mesh["tp"], {
        "tok": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)


def torch_step(model, optimizer, ids, targets, losses: list) -> None:
    from torch.distributed.tensor.parallel import loss_parallel

    optimizer.zero_grad()
    logits = model(ids)
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
    optimizer.step()
    losses.append(loss.detach())


def timed(fn) -> float:
    """``fn()``'s seconds on the slowest rank."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    seconds = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def compare_2d(rank: int, world: int, steps: int, warmup: int) -> dict:
    from engine.topology import Mesh

    dp, tp = 2, 2
    plan = Plan(dp=dp, tp=tp, zero=3)
    ours = parallelize(GPT(BENCH, seed=SEED), Mesh(dp=dp, tp=tp), plan, torch.optim.AdamW,
                       lr=LR, foreach=True)
    theirs, optimizer = torch_2d(BENCH, dp, tp)
    times = {"engine": [], "torch": []}
    ours_losses, their_losses = [], []
    for k in range(warmup + steps):
        batch = global_batch(k, BENCH_ROWS, BENCH.seq_len, BENCH.vocab, SEED + 1)
        mine = rank_slice(batch, dp, ours.mesh.coords.dp, 1, 0, "zigzag", 1)[0]
        t_ours = timed(lambda: ours_losses.append(train_step(ours, batch, k)))
        t_theirs = timed(lambda: torch_step(theirs, optimizer, mine.ids, mine.targets,
                                            their_losses))
        if k >= warmup:
            times["engine"].append(t_ours)
            times["torch"].append(t_theirs)
    # the same model and data: the same loss (PyTorch's: each dp rank's mean, averaged)
    theirs_full = torch.stack([x.full_tensor() for x in their_losses])
    dist.all_reduce(theirs_full)
    times["losses"] = (ours_losses, (theirs_full / world).tolist())
    return times


def row_speed(rank: int, world: int, row: Row, steps: int, warmup: int) -> list[float]:
    from engine.moe.layer import single_rank_group
    from engine.topology import Mesh

    plan, cfg = row.plan, model_config(row)
    mesh = Mesh(dp=plan.dp, tp=plan.tp, pp=plan.pp, cp=plan.cp, ep=plan.ep)
    alone = single_rank_group() if row.moe else None
    par = parallelize(GPT(cfg, seed=SEED, expert_group=alone), mesh, plan, torch.optim.AdamW,
                      lr=LR)
    times = []
    for k in range(warmup + steps):
        batch = global_batch(k, ROWS, cfg.seq_len, cfg.vocab, SEED + 1, row.varlen)
        seconds = timed(lambda: train_step(par, batch, k))
        if k >= warmup:
            times.append(seconds)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--no-rows", action="store_true", help="skip the parity rows' table")
    parser.add_argument("--only", default="", help="parity rows whose name contains this")
    args = parser.parse_args(argv)
    times = launch(compare_2d, 4, args.steps, args.warmup, backend="gloo", timeout=900,
                   quiet=True)[0]
    engine, torch_ = (statistics.median(times[k]) for k in ("engine", "torch"))
    tokens = BENCH_ROWS * BENCH.seq_len
    c = BENCH
    print(f"dp2 x tp2 ZeRO-3 (FSDP + TP): GPT vocab {c.vocab}, {c.layers} layers, hidden "
          f"{c.hidden}, {c.heads} heads ({c.kv_heads} KV), untied; {BENCH_ROWS} x {c.seq_len} "
          f"tokens per step; median of {args.steps} steps after {args.warmup} warm-up")
    print(f"{'variant':<34} {'step ms':>9} {'tokens/s':>9}")
    for name, t in (("engine parallelize + train_step", engine),
                    ("PyTorch fully_shard x DTensor TP", torch_)):
        print(f"{name:<34} {t * 1e3:>9.1f} {tokens / t:>9.0f}")
    print(f"ratio engine / PyTorch: {engine / torch_:.2f}x (target <= 1.10x)")
    ours, theirs = times["losses"]
    print("loss per step, engine:  " + " ".join(f"{x:.6f}" for x in ours))
    print("loss per step, PyTorch: " + " ".join(f"{x:.6f}" for x in theirs))
    if args.no_rows:
        return 0
    rows = [row for row in ALL_ROWS if args.only in row.name]
    print(f"\n{'parity row':<34} {'world':>5} {'step ms':>9} {'tokens/s':>9}")
    for row in rows:
        t = statistics.median(launch(row_speed, row.plan.world, row, args.steps, args.warmup,
                                     backend="gloo", timeout=600, quiet=True)[0])
        cfg = model_config(row)
        print(f"{row.name:<34} {row.plan.world:>5} {t * 1e3:>9.1f} "
              f"{ROWS * cfg.seq_len / t:>9.0f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
