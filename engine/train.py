"""``python -m engine train``: train the GPT on a dp x tp x pp mesh and report what a lab
cares about: memory per rank, tokens/s, MFU, the share of the step not spent computing, and
the pipeline bubble.

    python -m engine train --world-size 4 --dp 2 --tp 2 --steps 3          # CPU ranks, Gloo
    torchrun --nproc-per-node 8 -m engine train --dp 2 --tp 4 --pp 1        # one GPU node
    python -m engine train --world-size 2 --dp 2 --impl both               # vs torch DDP
    python -m engine train --world-size 2 --dp 2 --zero 0 --compress fp16 --impl both

Each rank builds its pipeline stage of a tensor-parallel TinyGPT (:mod:`engine.hybrid`), runs
the schedule (:mod:`engine.pp`), sums the tied embedding's gradient and steps a
:class:`engine.zero.ZeroOptimizer` over the data-parallel group. ``--impl torch`` runs a data-
parallel configuration on PyTorch's own DDP / ZeroRedundancyOptimizer / FSDP instead, and
``--impl both`` runs the two one after the other in the same launch for a side-by-side
tokens/s.

``--compress SPEC`` (``fp16``, ``bf16``, ``topk:0.01``, ``randomk:0.01``, ``powersgd:2``, as in
chapter 03) trains data-parallel without ZeRO through :class:`engine.dp.DataParallel` with that
compressor on its bucket all-reduce; with ``--impl torch|both`` the torch side registers
PyTorch's own DDP communication hook for fp16 or bf16 (``fp16_compress_hook``,
``bf16_compress_hook``). PyTorch has no hook for Top-K or Random-K, and its ``powerSGD_hook``
desynchronised the ranks inside this trainer, so those compare with ``--impl engine`` only
(chapter 03 checks our PowerSGD against that hook step by step).

MFU = model FLOPs per step (Megatron-LM eq. 3 without recomputation, ``72 B s l h^2 (...)``)
/ (step time x GPUs x peak FLOP/s). The peak comes from the GPU's name (A100 312, H100/H200
989 TFLOP/s bf16 dense) or ``--peak-tflops``; on CPUs MFU is shown only with that flag.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from engine import theory
from engine.models import GPTConfig, TinyGPT, token_data

MODELS = {
    "tiny": GPTConfig(vocab=64, seq_len=16, layers=2, heads=4, hidden=32),
    "small": GPTConfig(vocab=256, seq_len=64, layers=4, heads=4, hidden=128),
    "medium": GPTConfig(vocab=512, seq_len=128, layers=8, heads=8, hidden=256),
}
PEAK_TFLOPS = {"A100": 312, "H100": 989, "H200": 989, "L40S": 362, "A10": 125, "V100": 125}


@dataclass(frozen=True)
class TrainConfig:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 1
    schedule: str = "1f1b"
    microbatches: int = 2
    micro_batch: int = 4
    model: str = "tiny"
    steps: int = 3
    lr: float = 1e-2
    impl: str = "engine"  # "engine" | "torch" | "both"
    trace: str | None = None
    peak_tflops: float | None = None
    compress: str | None = None

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


def check_config(cfg: TrainConfig, world_size: int | None = None) -> None:
    """Every clear error we can give before a rank starts."""
    for name in ("dp", "tp", "pp", "microbatches", "micro_batch", "steps"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be an int >= 1, got {value!r}")
    if world_size is not None and cfg.world_size != world_size:
        raise ValueError(f"dp x tp x pp = {cfg.dp} x {cfg.tp} x {cfg.pp} = {cfg.world_size} "
                         f"does not match the world size {world_size}")
    if cfg.model not in MODELS:
        raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {cfg.model!r}")
    if cfg.zero not in (0, 1, 2, 3):
        raise ValueError(f"--zero must be 0, 1, 2 or 3, got {cfg.zero!r}")
    if cfg.zero == 3 and (cfg.tp > 1 or cfg.pp > 1):
        raise ValueError("--zero 3 runs here with data parallelism only (--tp 1 --pp 1); "
                         "with tp or pp use --zero 1 or 2")
    if cfg.schedule not in ("1f1b", "gpipe"):
        raise ValueError(f"--schedule must be 1f1b or gpipe, got {cfg.schedule!r}")
    if cfg.impl not in ("engine", "torch", "both"):
        raise ValueError(f"--impl must be engine, torch or both, got {cfg.impl!r}")
    if cfg.impl != "engine" and (cfg.tp > 1 or cfg.pp > 1):
        raise ValueError("--impl torch/both compares data-parallel configurations (--tp 1 "
                         "--pp 1): DDP, ZeroRedundancyOptimizer or FSDP by --zero")
    if cfg.compress is not None:
        from engine.compress.experiment import make_compressor

        make_compressor(cfg.compress)  # a bad spec is a clear ValueError naming it
        if cfg.tp > 1 or cfg.pp > 1 or cfg.zero != 0:
            raise ValueError(f"--compress {cfg.compress} runs on data parallelism without ZeRO "
                             "(--tp 1 --pp 1 --zero 0): the compressor plugs into "
                             "DataParallel's bucket all-reduce")
        if cfg.impl != "engine" and cfg.compress.split(":")[0] in ("topk", "randomk"):
            raise ValueError(f"--impl {cfg.impl} --compress {cfg.compress}: PyTorch has no "
                             "DDP hook for Top-K or Random-K; use --impl engine")
        if cfg.impl != "engine" and cfg.compress.startswith("powersgd"):
            # measured with torch 2.13 on Gloo, --model small: with no_sync accumulation, or
            # after the engine's run in the same launch, the ranks' collectives stopped
            # matching ("Received data size doesn't match expected size") and a rank aborted
            raise ValueError(f"--impl {cfg.impl} --compress {cfg.compress}: PyTorch's "
                             "powerSGD_hook desynchronised the ranks in this trainer (torch "
                             "2.13, Gloo); compare PowerSGD with --impl engine, or fp16/bf16 "
                             "with --impl both")
    model = MODELS[cfg.model]
    from engine.tp.blocks import check_tp_degree

    check_tp_degree(model, cfg.tp)
    if cfg.pp > model.layers:
        raise ValueError(f"--pp {cfg.pp} needs at least {cfg.pp} layers; --model {cfg.model} "
                         f"has {model.layers}")


def peak_flops(cfg: TrainConfig) -> float | None:
    if cfg.peak_tflops:
        return cfg.peak_tflops * 1e12
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, tflops in PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12
    return None


def model_flops(model: GPTConfig, sequences: int) -> float:
    return theory.transformer_flops(sequences, model.seq_len, model.layers, model.hidden,
                                    model.vocab, recompute=False)


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _engine_steps(rank, world_size, cfg: TrainConfig):
    from engine.comm import CommMeter
    from engine.hybrid import GPTStage
    from engine.pp import gpipe, one_f_one_b, run_pipeline
    from engine.topology import Mesh
    from engine.tp.layers import vocab_parallel_cross_entropy
    from engine.zero import ZeroDataParallel, ZeroOptimizer

    model_cfg = MODELS[cfg.model]
    device = _device()
    mesh = Mesh(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp)
    rows = cfg.microbatches * cfg.micro_batch
    ids, targets = token_data(cfg.dp * rows, model_cfg.seq_len, model_cfg.vocab, seed=1)
    ids, targets = ids.to(device), targets.to(device)
    mine = slice(mesh.coords.dp * rows, (mesh.coords.dp + 1) * rows)
    inputs = list(ids[mine].chunk(cfg.microbatches))
    labels = list(targets[mine].chunk(cfg.microbatches))
    if cfg.compress is not None:
        from engine.compress.experiment import make_compressor
        from engine.dp import DataParallel

        stage = DataParallel(TinyGPT(model_cfg, seed=0).to(device),
                             compressor=make_compressor(cfg.compress))
        optimizer = torch.optim.AdamW(stage.parameters(), lr=cfg.lr)

        def loss_fn(logits, y):
            return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    elif cfg.zero == 3:
        wrapped = ZeroDataParallel(TinyGPT(model_cfg, seed=0).to(device), torch.optim.AdamW,
                                   group=mesh.dp_group, lr=cfg.lr)
        stage, optimizer = wrapped, wrapped.optimizer

        def loss_fn(logits, y):
            return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    else:
        stage = GPTStage(TinyGPT(model_cfg, seed=0).to(device), mesh)
        optimizer = ZeroOptimizer(list(stage.parameters()), torch.optim.AdamW, stage=cfg.zero,
                                  group=mesh.dp_group, lr=cfg.lr)

        def loss_fn(logits, y):
            return vocab_parallel_cross_entropy(logits, y, mesh.tp_group).mean()
    plan = (one_f_one_b if cfg.schedule == "1f1b" else gpipe)(cfg.pp, cfg.microbatches)
    steps, events, losses, last_run, comm_bytes = [], [], [], None, 0
    for step in range(cfg.steps + 1):  # the first step warms up
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        with CommMeter() as meter:
            if cfg.compress is not None:
                run = _accumulate(stage, inputs, labels, loss_fn, rank)
            else:
                run = run_pipeline([stage], plan, inputs, labels, loss_fn,
                                   stage=mesh.coords.pp, group=mesh.pp_group)
                if cfg.zero != 3:
                    stage.sync_tied_embedding()
            optimizer.step()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step:
            steps.append(elapsed.item())
            events = run.events
            comm_bytes = meter.bytes_sent
            if run.loss is not None:
                losses.append(run.loss)
            if rank == 0:
                print(f"  step {step}/{cfg.steps}: {elapsed.item() * 1e3:.1f} ms", flush=True)
        last_run = run
    if cfg.compress is not None:
        from engine.memory import model_state_bytes

        held = model_state_bytes(stage, optimizer)
    else:
        held = optimizer.state_bytes() if hasattr(optimizer, "state_bytes") \
            else stage.state_bytes()
    compute = sum(e.end - e.start for e in events)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, [(e.name, e.rank, e.start, e.end, dict(e.args))
                                      for e in events])
    cuda_peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return {"step_s": statistics.median(steps), "losses": losses, "compute_s": compute,
            "cuda_peak": cuda_peak,
            "state": held, "activations": last_run.peak_activation_bytes,
            "comm_bytes": comm_bytes, "coords": mesh.coords,
            "events": gathered if rank == 0 else None}


def _accumulate(model, inputs, labels, loss_fn, rank):
    """One data-parallel step over the micro-batches: gradients accumulate locally
    (``no_sync``) and are all-reduced, through the compressor, in the last backward only. The
    same :class:`engine.pp.PipelineRun` as a one-stage pipeline reports."""
    from engine.memory import ActivationTracker
    from engine.pp import PipelineRun
    from engine.trace import TraceEvent

    m, events, total, peak = len(inputs), [], 0.0, 0
    params = list(model.parameters())
    for mb, (x, y) in enumerate(zip(inputs, labels, strict=True)):
        sync = contextlib.nullcontext() if mb == m - 1 else model.no_sync()
        with sync:
            start = time.perf_counter()
            with ActivationTracker(exclude=params) as acts:
                loss = loss_fn(model(x), y) / m
            loss.backward()
            end = time.perf_counter()
        peak = max(peak, acts.bytes)
        total += loss.item()
        events.append(TraceEvent(f"FB{mb}", rank, start, end, lane="compute",
                                 args={"kind": "FB", "mb": mb, "chunk": 0}))
    return PipelineRun(total, events, peak, {0: peak}, 1)


def _torch_steps(rank, world_size, cfg: TrainConfig):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model_cfg = MODELS[cfg.model]
    device = _device()
    rows = cfg.microbatches * cfg.micro_batch
    ids, targets = token_data(cfg.dp * rows, model_cfg.seq_len, model_cfg.vocab, seed=1)
    ids, targets = ids[rank * rows:(rank + 1) * rows].to(device), \
        targets[rank * rows:(rank + 1) * rows].to(device)
    gpt = TinyGPT(model_cfg, seed=0).to(device)
    if cfg.zero >= 2:
        strategy = ShardingStrategy.SHARD_GRAD_OP if cfg.zero == 2 else \
            ShardingStrategy.FULL_SHARD
        model = FSDP(gpt, device_id=device, sharding_strategy=strategy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    else:
        model = nn.parallel.DistributedDataParallel(gpt)
        if cfg.compress is not None:
            _register_torch_hook(model, cfg.compress)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=cfg.lr) \
            if cfg.zero == 1 else torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    steps = []
    for step in range(cfg.steps + 1):
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        for i, (x, y) in enumerate(zip(ids.chunk(cfg.microbatches),
                                       targets.chunk(cfg.microbatches))):
            last = i == cfg.microbatches - 1  # synchronise once, after the last micro-batch
            with contextlib.nullcontext() if last else model.no_sync():
                logits = model(x)
                loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
                (loss / cfg.microbatches).backward()
        optimizer.step()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step:
            steps.append(elapsed.item())
    return {"step_s": statistics.median(steps)}


def _register_torch_hook(model, spec: str) -> None:
    """PyTorch's own DDP communication hook for the compressor ``spec`` names."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    kind = spec.split(":")[0]
    if kind == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif kind == "bf16":
        if dist.get_backend() != "nccl":
            raise ValueError("PyTorch's bf16_compress_hook needs NCCL; on Gloo compare "
                             "--compress fp16, or run bf16 with --impl engine")
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif kind != "dense":  # refused by check_config before any rank starts
        raise ValueError(f"no PyTorch DDP hook for --compress {spec}")


def _both(rank, world_size, cfg: TrainConfig):
    out = {}
    if cfg.impl in ("engine", "both"):
        out["engine"] = _engine_steps(rank, world_size, cfg)
    if cfg.impl in ("torch", "both"):
        out["torch"] = _torch_steps(rank, world_size, cfg)
    return out


def report(cfg: TrainConfig, results: list[dict]) -> dict:
    """Print the lab's numbers from every rank's results; return them."""
    model_cfg = MODELS[cfg.model]
    sequences = cfg.dp * cfg.microbatches * cfg.micro_batch
    tokens = sequences * model_cfg.seq_len
    peak = peak_flops(cfg)
    summary = {}
    print(f"\n{cfg.model} GPT ({sum(p.numel() for p in TinyGPT(model_cfg).parameters()):,} "
          f"parameters) on dp {cfg.dp} x tp {cfg.tp} x pp {cfg.pp}, ZeRO-{cfg.zero}, "
          f"{cfg.schedule}, {cfg.microbatches} micro-batches of {cfg.micro_batch}"
          + (f", gradients compressed with {cfg.compress}" if cfg.compress else ""))
    for impl in ("engine", "torch"):
        if impl not in results[0]:
            continue
        step = results[0][impl]["step_s"]
        summary[impl] = {"tokens_per_s": tokens / step, "step_s": step}
        mfu = model_flops(model_cfg, sequences) / (step * cfg.world_size * peak) if peak \
            else None
        summary[impl]["mfu"] = mfu
        print(f"[{impl}] step {step * 1e3:.1f} ms, {tokens / step:,.0f} tokens/s"
              + (f", MFU {mfu:.1%}" if mfu is not None else
                 ", MFU n/a (give --peak-tflops on CPUs)"))
    if "engine" in results[0]:
        from engine.pp import measured_bubble
        from engine.trace import TraceEvent

        engine = [r["engine"] for r in results]
        step = engine[0]["step_s"]
        for r in engine:
            s = r["state"]
            c = r["coords"]
            print(f"  rank dp{c.dp} tp{c.tp} pp{c.pp}: params {s.params / 1e6:.2f} MB, grads "
                  f"{s.grads / 1e6:.2f} MB, optimizer {s.optimizer / 1e6:.2f} MB, activations "
                  f"{r['activations'] / 1e6:.2f} MB; computing {r['compute_s'] / step:.0%} "
                  f"of the step; sent {_bytes(r['comm_bytes'])}"
                  + (f"; CUDA peak {r['cuda_peak'] / 1e9:.2f} GB" if r["cuda_peak"] else ""))
        events = [TraceEvent(name, rank, start, end, "compute", args)
                  for per_rank in engine[0]["events"]
                  for name, rank, start, end, args in per_rank]
        if cfg.pp > 1:
            stage_events = [e for e in events if e.rank in _first_pipeline(cfg)]
            bubble = measured_bubble(stage_events, cfg.pp)
            print(f"  pipeline idle outside forward/backward (one pipeline; tensor-parallel "
                  f"waits count as busy): {bubble:.1%}; bubble formula "
                  f"{theory.bubble_fraction(cfg.pp, cfg.microbatches):.1%}")
            summary["bubble"] = bubble
        summary["non_compute_share"] = 1 - min(r["compute_s"] for r in engine) / step
        if cfg.trace:
            from engine.trace import to_chrome_trace

            to_chrome_trace(events, cfg.trace)
            print(f"  Chrome trace: {cfg.trace}")
    if "engine" in summary and "torch" in summary:
        ratio = summary["engine"]["tokens_per_s"] / summary["torch"]["tokens_per_s"]
        print(f"engine / torch tokens/s: {ratio:.2f}x")
        summary["ratio"] = ratio
    return summary


def _bytes(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.2f} KB"


def _first_pipeline(cfg: TrainConfig) -> set[int]:
    return {p * cfg.dp * cfg.tp for p in range(cfg.pp)}  # dp 0, tp 0 of every stage


def run_on_gpus(args: list[str], gpus_needed: int) -> int | None:
    """For the notebooks' GPU-lab cells: with at least ``gpus_needed`` CUDA GPUs here, run
    ``python -m engine train ARGS --backend nccl`` now (one GPU per rank) and return its exit
    code; otherwise print the commands to run in the GPU lab and return None."""
    cfg, parsed = _parse(args)
    check_config(cfg, parsed.world_size or cfg.world_size)  # a wrong cell fails on a CPU too
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have >= gpus_needed:
        return main([*args, "--backend", "nccl"])
    options = " ".join(a for i, a in enumerate(args)  # torchrun sets the world size
                       if a != "--world-size" and (i == 0 or args[i - 1] != "--world-size"))
    print(f"{have} GPU(s) here; this cell needs {gpus_needed}. In the GPU lab:\n"
          f"  python -m engine train {' '.join(args)} --backend nccl\n"
          f"  torchrun --nproc-per-node {gpus_needed} -m engine train {options}")
    return None


def _parse(argv) -> tuple[TrainConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="python -m engine train", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--world-size", type=int, help="ranks to launch (not under torchrun)")
    for name in ("dp", "tp", "pp"):
        parser.add_argument(f"--{name}", type=int, default=1)
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--impl", default="engine")
    parser.add_argument("--compress", help="gradient compression on data parallelism "
                        "(--zero 0): fp16, bf16, topk:RATIO, randomk:RATIO, powersgd:RANK")
    parser.add_argument("--trace", help="write a Chrome trace of the last step")
    parser.add_argument("--peak-tflops", type=float)
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    args = parser.parse_args(argv)
    cfg = TrainConfig(dp=args.dp, tp=args.tp, pp=args.pp, zero=args.zero,
                      schedule=args.schedule, microbatches=args.microbatches,
                      micro_batch=args.micro_batch, model=args.model, steps=args.steps,
                      impl=args.impl, trace=args.trace, peak_tflops=args.peak_tflops,
                      compress=args.compress)
    return cfg, args


def main(argv=None) -> int:
    cfg, args = _parse(argv)
    from engine.launch import _under_torchrun, launch

    world = int(os.environ["WORLD_SIZE"]) if _under_torchrun() else (args.world_size or
                                                                      cfg.world_size)
    try:
        check_config(cfg, world)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"training on {world} rank(s)...", flush=True)
    results = launch(_both, world, cfg, backend=args.backend)
    if _under_torchrun() and dist.is_initialized() and dist.get_rank() != 0:
        return 0
    report(cfg, results)
    return 0
