"""Pipeline bubbles measured on real ranks vs the formula, activation memory, zero-bubble
schedules, and the stage-imbalance experiment.

For each schedule and m, one training step of an 8-block MLP cut into p stages runs on p Gloo
ranks; the bubble is the idle share of the ranks' compute timelines. Beside it: the formula
(p-1)/(m+p-1), and the simulator fed with the measured per-stage forward/backward times
(what remains between those two columns is communication). Then 1F1B, ZB-H1 and ZB-V side by
side: the bubble per stage measured and simulated (with the measured F, B and W times), the
ZB-H1 formula, and the bytes each stage holds (activations, and the inputs and output
gradients stashed for W), the median of --repeats launches. Last, a model whose first two
blocks are 4x heavier, cut uniformly and cut by balanced_boundaries from profiled layer
times.

    python benchmarks/pipeline.py [--p 2] [--rows 512] [--width 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics

from engine import launch, theory
from engine.pp import (balanced_boundaries, gpipe, measured_bubble, measured_idle, one_f_one_b,
                       simulate, stage_times, uniform_boundaries)
from engine.labs.pipeline import pipeline_step, profile_layers, schedule_by_name

MB = 2**20


def bubble_table(p, rows, width, ms=(1, 2, 4, 8)):
    lines = []
    for kind, make in (("gpipe", gpipe), ("1f1b", one_f_one_b)):
        for m in ms:
            runs = launch(pipeline_step, p, kind, m, uniform_boundaries(8, p), [width] * 8,
                          rows)
            events = [e for run in runs for e in run.events]
            times = stage_times(events)
            simulated = simulate(make(p, m), t_f=times["F"], t_b=times["B"]).bubble
            lines.append((kind, m, measured_bubble(events, p), simulated,
                          theory.bubble_fraction(p, m),
                          [run.peak_activation_bytes for run in runs]))
    return lines


def zero_bubble_table(p, rows, width, m, repeats):
    """Per schedule: measured and simulated idle share per stage (medians over ``repeats``
    launches), the ZB-H1 formula at the measured mean times, and the memory per stage."""
    lines = []
    for kind in ("1f1b", "zb_h1", "zb_v"):
        built = schedule_by_name(kind, p, m)
        schedule, placement, v = built.actions, built.placement, built.v
        measured, simulated, formula, costs = [], [], [], []
        for _ in range(repeats):
            runs = launch(pipeline_step, p, kind, m, uniform_boundaries(8, p * v),
                          [width] * 8, rows)
            events = [e for run in runs for e in run.events]
            times = stage_times(events, v)
            w = times.get("W", [0.0] * p)
            sim = simulate(schedule, t_f=times["F"], t_b=times["B"], t_w=w,
                           placement=placement)
            measured.append(list(measured_idle(events).values()))
            costs.append([times[k][s] if k in times else 0.0 for s in range(p) for k in "FBW"])
            simulated.append([idle / sim.total for idle in sim.idle().values()])
            if kind == "zb_h1":
                t_f, t_b, t_w = (statistics.mean(times[k]) for k in "FBW")
                formula.append(theory.zb_h1_bubble_fraction(p, m, t_f, t_b, t_w)
                               if t_w <= min(t_f, t_b) else None)
        known = [f for f in formula if f is not None]
        lines.append((kind, [statistics.median(x) for x in zip(*measured)],
                      [statistics.median(x) for x in zip(*simulated)],
                      (statistics.median(known) if known else "W > F or B") if formula
                      else None, [statistics.median(x) for x in zip(*costs)], runs))
    return lines


def imbalance(rows, width):
    widths = [4 * width, 4 * width] + [width] * 6
    times = profile_layers(widths, rows)
    out = {}
    for name, starts in (("uniform", uniform_boundaries(8, 2)),
                         ("balanced", balanced_boundaries(times, 2))):
        runs = launch(pipeline_step, 2, "1f1b", 8, starts, widths, rows)
        events = [e for run in runs for e in run.events]
        out[name] = (starts, max(e.end for e in events) - min(e.start for e in events))
    return times, out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, default=2)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--m", type=int, default=8, help="micro-batches, zero-bubble table")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--zero-bubble-only", action="store_true",
                        help="only the zero-bubble table")
    args = parser.parse_args(argv)
    print(f"p = {args.p} Gloo ranks, 8 blocks of width {args.width}, {args.rows} rows per "
          "micro-batch")
    if not args.zero_bubble_only:
        print_bubble_table(args)
    print_zero_bubble_table(args)
    if not args.zero_bubble_only:
        print_imbalance(args)


def print_bubble_table(args):
    print(f"{'schedule':<8}{'m':>3}{'measured':>10}{'simulated*':>11}{'formula':>9}"
          f"{'peak activation KB per stage':>31}")
    for kind, m, measured, simulated, formula, peaks in bubble_table(args.p, args.rows,
                                                                     args.width):
        print(f"{kind:<8}{m:>3}{measured:>10.3f}{simulated:>11.3f}{formula:>9.3f}   "
              + ", ".join(f"{b // 1024}" for b in peaks))
    print("* the simulator fed with each stage's measured forward and backward times")


def print_zero_bubble_table(args):
    print(f"\nzero-bubble schedules, p = {args.p}, m = {args.m}, median of {args.repeats} "
          "launches: idle share of the run per stage")
    print(f"{'schedule':<8}{'measured':>16}{'simulated*':>18}{'ZB-H1 formula':>15}   "
          "per stage: F/B/W ms; peak held MB (of it output gradients for W); one "
          "micro-batch's activations / W-stash MB")
    for kind, measured, simulated, formula, costs, runs in zero_bubble_table(
            args.p, args.rows, args.width, args.m, args.repeats):
        per_stage = " | ".join(
            "/".join(f"{t * 1e3:.0f}" for t in costs[3 * s:3 * s + 3])
            + f"; {r.peak_activation_bytes / MB:.0f} ({r.peak_grad_stash_bytes / MB:.0f}); "
            f"{sum(r.activation_bytes.values()) / MB:.0f} / "
            f"{sum(r.weight_stash_bytes.values()) / MB:.0f}" for s, r in enumerate(runs))
        shown = "" if formula is None else formula if isinstance(formula, str) else \
            f"{formula:.3f}"
        print(f"{kind:<8}{', '.join(f'{x:.3f}' for x in measured):>16}"
              f"{', '.join(f'{x:.3f}' for x in simulated):>18}{shown:>15}   {per_stage}")
    print("* with each stage's measured F, B and W times (a V schedule: per chunk x 2)")


def print_imbalance(args):
    times, result = imbalance(args.rows, args.width)
    print("\nimbalanced model (blocks 0-1 are 4x wider), p = 2, 1F1B, m = 8")
    print("profiled fwd+bwd ms per block: " + ", ".join(f"{t * 1e3:.1f}" for t in times))
    for name, (starts, seconds) in result.items():
        print(f"  {name:<9} cut at {starts}: step {seconds * 1e3:.0f} ms")
    speedup = result["uniform"][1] / result["balanced"][1]
    print(f"  balanced partition: {speedup:.2f}x faster than the uniform one")


if __name__ == "__main__":
    main()
