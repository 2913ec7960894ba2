"""Pipeline bubbles measured on real ranks vs the formula, activation memory, and the
stage-imbalance experiment (issue 8).

For each schedule and m, one training step of an 8-block MLP cut into p stages runs on p Gloo
ranks; the bubble is the idle share of the ranks' compute timelines. Beside it: the formula
(p-1)/(m+p-1), and the simulator fed with the measured per-stage forward/backward times
(what remains between those two columns is communication). Then a model whose first two
blocks are 4x heavier, cut uniformly and cut by balanced_boundaries from profiled layer
times.

    python benchmarks/pipeline.py [--p 2] [--rows 512] [--width 512]
"""

from __future__ import annotations

import argparse
import statistics

from engine import launch, theory
from engine.pp import (balanced_boundaries, gpipe, measured_bubble, one_f_one_b, simulate,
                       uniform_boundaries)
from engine.pp.experiments import pipeline_step, profile_layers


def stage_costs(runs):
    """Median forward and backward seconds per stage, from measured events."""
    t_f, t_b = [], []
    for run in runs:
        t_f.append(statistics.median(e.end - e.start for e in run.events if e.name[0] == "F"))
        t_b.append(statistics.median(e.end - e.start for e in run.events if e.name[0] == "B"))
    return t_f, t_b


def bubble_table(p, rows, width, ms=(1, 2, 4, 8)):
    lines = []
    for kind, make in (("gpipe", gpipe), ("1f1b", one_f_one_b)):
        for m in ms:
            runs = launch(pipeline_step, p, kind, m, uniform_boundaries(8, p), [width] * 8,
                          rows)
            events = [e for run in runs for e in run.events]
            t_f, t_b = stage_costs(runs)
            simulated = simulate(make(p, m), t_f=t_f, t_b=t_b).bubble
            lines.append((kind, m, measured_bubble(events, p), simulated,
                          theory.bubble_fraction(p, m),
                          [run.peak_activation_bytes for run in runs]))
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
    args = parser.parse_args(argv)
    print(f"p = {args.p} Gloo ranks, 8 blocks of width {args.width}, {args.rows} rows per "
          "micro-batch")
    print(f"{'schedule':<8}{'m':>3}{'measured':>10}{'simulated*':>11}{'formula':>9}"
          f"{'peak activation KB per stage':>31}")
    for kind, m, measured, simulated, formula, peaks in bubble_table(args.p, args.rows,
                                                                     args.width):
        print(f"{kind:<8}{m:>3}{measured:>10.3f}{simulated:>11.3f}{formula:>9.3f}   "
              + ", ".join(f"{b // 1024}" for b in peaks))
    print("* the simulator fed with each stage's measured forward and backward times")
    times, result = imbalance(args.rows, args.width)
    print("\nimbalanced model (blocks 0-1 are 4x wider), p = 2, 1F1B, m = 8")
    print("profiled fwd+bwd ms per block: " + ", ".join(f"{t * 1e3:.1f}" for t in times))
    for name, (starts, seconds) in result.items():
        print(f"  {name:<9} cut at {starts}: step {seconds * 1e3:.0f} ms")
    speedup = result["uniform"][1] / result["balanced"][1]
    print(f"  balanced partition: {speedup:.2f}x faster than the uniform one")


if __name__ == "__main__":
    main()
