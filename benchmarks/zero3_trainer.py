"""The ZeRO-3 ratio of ``engine train --zero 3 --impl both``, measured properly and taken apart.

The trainer times 3 steps of each implementation one after the other; this script builds the
same two strategies the trainer builds (:func:`engine.train.run.build`, on the same GPT,
:func:`engine.train.composed.model_config`, each step on the composed engine's batch of that
step, :func:`engine.model.data.global_batch`) and times them interleaved (each repeat runs
both, the order alternating) after a warm-up:

* ``engine (trainer)``: ``engine train --zero 3``'s ZeRO-3, the per-parameter design's
  ``fully_shard`` groups (:mod:`engine.fsdp`), its groups printed as units;
* ``torch (trainer)``: ``engine train --zero 3 --impl torch``'s FSDP, each transformer block
  wrapped.

Each step is the slowest rank's (times all-reduced with MAX); the table prints the median, the
10th/90th percentiles, the number of units and the collectives per step (ZeRO-3's
all-gathers and reduce-scatters, counted with :class:`engine.observe.meter.CommMeter` for the
engine, the trainer's one all-reduce of the step's loss left out; for FSDP from its units: per
micro-batch one all-gather per unit in forward and in backward, one reduce-scatter per unit on
the last).
``--profile`` also runs ``cProfile`` over a few engine steps on rank 0 and prints the functions
that took longest (cumulative).

    python benchmarks/zero3_trainer.py [--model tiny] [--warmup 3] [--repeats 15] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import torch.distributed as dist

from engine import launch
from engine.observe.meter import CommMeter
from engine.model.presets import MODELS
from engine.train.run import build
from engine.train.cli import parse
from engine.train.composed import plan_of

ZERO3_OPS = ("all_gather", "reduce_scatter")  # what a ZeRO-3 step sends, per unit
VARIANTS = ("engine (trainer)", "torch (trainer)")


def _units(strategy) -> int:
    model = strategy.model
    if hasattr(model, "all_units"):
        return len(model.all_units)
    if hasattr(model, "sharded_step"):  # the composed engine's fully_shard groups
        return len(model.sharded_step.groups)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    return len(FSDP.fsdp_modules(model))


def _run(rank, world_size, argv, warmup, repeats, profile):
    torch.set_num_threads(1)
    cfg, _, _ = parse(argv)
    device = torch.device("cpu")
    plan = plan_of(cfg)
    mesh = plan.mesh()
    built = {VARIANTS[0]: build(cfg, "engine", plan, device, "fp32", mesh),
             VARIANTS[1]: build(cfg, "torch", plan, device, "fp32", mesh)}
    taken = dict.fromkeys(VARIANTS, 0)  # the trainer's strategies step on step k's batch

    def step(name):
        taken[name] += 1
        return built[name].step(taken[name] - 1)

    collectives = {}
    for name in VARIANTS[:1]:
        with CommMeter(count="model") as meter:
            step(name)
        collectives[name] = sum(e.op in ZERO3_OPS for e in meter.events)
    m = cfg.microbatches
    for name in VARIANTS[1:]:
        units = _units(built[name])
        collectives[name] = 2 * m * units + units  # gathers per micro-batch, one reduce-scatter
    times = {name: [] for name in VARIANTS}
    order = list(VARIANTS)
    for repeat in range(warmup + repeats):
        shift = repeat % len(order)
        for name in order[shift:] + order[:shift]:
            dist.barrier()
            start = time.perf_counter()
            step(name)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if repeat >= warmup:
                times[name].append(elapsed.item())
    text = None
    if profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(5):
            built[VARIANTS[0]].step(0)
        profiler.disable()
        if rank == 0:
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(14)
            text = out.getvalue()
    return times, {n: _units(built[n]) for n in VARIANTS}, collectives, text


def _pct(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=tuple(MODELS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    trainer = ["--world-size", "2", "--dp", "2", "--zero", "3", "--model", args.model]
    results = launch(_run, 2, trainer, args.warmup, args.repeats, args.profile,
                     backend="gloo", timeout=1800, quiet=True)
    times, units, collectives, text = results[0]
    cfg, _, _ = parse(trainer)
    tokens = 2 * cfg.microbatches * cfg.micro_batch * MODELS[args.model].seq_len
    print(f"2 Gloo ranks, --model {args.model}, {cfg.microbatches} micro-batches of "
          f"{cfg.micro_batch} sequences a rank ({tokens} tokens a step); {args.warmup} warm-up "
          f"step(s), then {args.repeats} interleaved repeats; each step the slowest rank's")
    print(f"{'variant':<26}{'units':>6}{'colls/step':>11}{'median ms':>11}{'p10':>8}{'p90':>8}"
          f"{'tokens/s':>10}")
    medians = {}
    for name in VARIANTS:
        t = times[name]
        medians[name] = statistics.median(t)
        print(f"{name:<26}{units[name]:>6}{collectives[name]:>11}{medians[name] * 1e3:>11.1f}"
              f"{_pct(t, .1) * 1e3:>8.1f}{_pct(t, .9) * 1e3:>8.1f}"
              f"{tokens / medians[name]:>10,.0f}")
    ours, theirs = VARIANTS
    print(f"tokens/s {ours} / {theirs}: {medians[theirs] / medians[ours]:.2f}x")
    if text:
        print("\ncProfile of 5 steps of the trainer's ZeRO-3 (the engine's) on rank 0 (by own "
              "time):")
        print(text)
    return medians


if __name__ == "__main__":
    main()
