"""Where the CPU pipeline's idle time goes: ``engine train --pp P``'s own strategy, taken apart.

For each pipeline depth ``p`` and micro-batch count ``m`` this builds the trainer's strategy
(:func:`engine.train.run.build`: the composed engine, ``--pp p``, 1F1B, the GPT of ``--model``)
on ``p`` Gloo ranks, runs ``--warmup`` steps, then ``--repeats`` steps, and from each step's
trace splits the idle share
``1 - busy / (p x span)`` (:func:`engine.pp.measured_bubble`, ``span`` from the first forward to
the last backward) into the parts below. The trace is the :class:`engine.pp.PipelineRun` that
the pipeline runtime (:func:`engine.pp.run_pipeline`) returns inside the trainer's step
(:func:`engine.compose.pipeline.pipeline_backward`): its compute events and point-to-point
spans. The trainer's step returns the compute events alone (its report's idle line needs no
more), so :func:`recorded_runs` keeps each whole run the runtime returns while the trainer's
own step runs:

* **p2p**: inside a batch of sends and receives (posting it and waiting for the peer: the
  schedule's own waits, the transfer, and a peer descheduled by the OS);
* **fill/drain**: before the rank's first compute or after its last one, outside a batch;
* **host**: the rest, the runtime's Python between operations on this rank.

Beside them: the formula ``(p-1)/(m+p-1)`` and the simulator (:func:`engine.pp.simulate`) fed
that step's median forward and backward time of each stage (unequal stages included, hand-offs
free), and the simulator again with every message delayed by the 10th percentile of the
step's batch spans (the cost of a hand-off whose peer is ready: ``t_comm``). Every share is
the median over the repeats; the measured idle also gets its 10th and
90th percentiles.

    python benchmarks/pipeline_idle.py [--model small] [--p 2 4] [--m 4 8] [--repeats 10]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch

import engine.compose.pipeline as composed_pipeline
from engine import launch, theory
from engine.pp import build_schedule, measured_bubble, simulate
from engine.model.presets import MODELS
from engine.train.run import build
from engine.train.cli import parse
from engine.train.composed import plan_of


def _clip(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


def breakdown(runs: list, p: int, m: int) -> dict[str, float]:
    """The idle shares of one step from each stage's :class:`engine.pp.PipelineRun`."""
    events = [e for run in runs for e in run.events]
    lo, hi = min(e.start for e in events), max(e.end for e in events)
    span = hi - lo
    shares = {"idle": measured_bubble(events, p), "p2p": 0.0, "fill/drain": 0.0}
    for run in runs:
        first = min(e.start for e in run.events)
        last = max(e.end for e in run.events)
        shares["p2p"] += sum(_clip(e.start, e.end, lo, hi) for e in run.p2p_events)
        outside = [(lo, first), (last, hi)]  # fill/drain, less any batch inside it
        shares["fill/drain"] += sum(b - a - sum(_clip(e.start, e.end, a, b)
                                                for e in run.p2p_events) for a, b in outside)
    shares["p2p"] /= p * span
    shares["fill/drain"] /= p * span
    shares["host"] = shares["idle"] - shares["p2p"] - shares["fill/drain"]
    times = {kind: [statistics.median(e.seconds for e in run.events if e.args["kind"] == kind)
                    for run in runs] for kind in "FB"}
    schedule = build_schedule("1f1b", p, m).actions
    shares["simulator"] = simulate(schedule, t_f=times["F"], t_b=times["B"]).bubble
    rounds = sorted(e.seconds for run in runs for e in run.p2p_events)
    shares["hand-off ms"] = rounds[len(rounds) // 10] * 1e3  # a batch whose peer was ready
    shares["sim+hand-off"] = simulate(schedule, t_f=times["F"], t_b=times["B"],
                                      t_comm=rounds[len(rounds) // 10]).bubble
    shares["F ms"] = [t * 1e3 for t in times["F"]]
    shares["B ms"] = [t * 1e3 for t in times["B"]]
    return shares


@contextlib.contextmanager
def recorded_runs(runs: list):
    """While open, every :class:`engine.pp.PipelineRun` that the composed engine's pipeline
    step gets from the runtime is appended to ``runs`` (the step itself is unchanged)."""
    original = composed_pipeline.run_pipeline

    def recording(*args, **kwargs):
        run = original(*args, **kwargs)
        runs.append(run)
        return run

    composed_pipeline.run_pipeline = recording
    try:
        yield runs
    finally:
        composed_pipeline.run_pipeline = original


def _run(rank, world_size, argv, warmup, repeats):
    torch.set_num_threads(1)
    cfg, _, _ = parse(argv)
    device = torch.device("cpu")
    plan = plan_of(cfg)
    strategy = build(cfg, "engine", plan, device, "fp32", plan.mesh())
    runs = []
    with recorded_runs([]) as recorded:
        for i in range(warmup + repeats):
            torch.distributed.barrier()
            strategy.step(i)  # the trainer's step i: its global batch
            if i >= warmup:
                runs.append(recorded[-1])
    return runs


def _pct(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", choices=tuple(MODELS))
    parser.add_argument("--p", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--m", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    print(f"--model {args.model}, 1F1B, Gloo ranks; {args.warmup} warm-up step(s), then the "
          f"median over {args.repeats} steps (idle: [p10, p90]); shares of p x span")
    print(f"{'p':>2}{'m':>3}{'formula':>9}{'simulator':>10}{'+hand-off':>10}{'(ms)':>6}"
          f"{'measured idle':>22}{'p2p':>7}{'fill/drain':>11}{'host':>7}"
          "   stage F / B ms (median)")
    out = {}
    for p in args.p:
        for m in args.m:
            trainer = ["--world-size", str(p), "--pp", str(p), "--microbatches", str(m),
                       "--model", args.model]
            per_rank = launch(_run, p, trainer, args.warmup, args.repeats, backend="gloo",
                              timeout=1800, quiet=True)
            steps = [breakdown([runs[i] for runs in per_rank], p, m)
                     for i in range(args.repeats)]
            med = {k: statistics.median(s[k] for s in steps)
                   for k in ("idle", "p2p", "fill/drain", "host", "simulator",
                             "sim+hand-off", "hand-off ms")}
            idle = [s["idle"] for s in steps]
            f_ms = [statistics.median(s["F ms"][r] for s in steps) for r in range(p)]
            b_ms = [statistics.median(s["B ms"][r] for s in steps) for r in range(p)]
            stages = " ".join(f"{f:.1f}/{b:.1f}" for f, b in zip(f_ms, b_ms))
            idle_text = f"{med['idle']:.1%} [{_pct(idle, .1):.0%}, {_pct(idle, .9):.0%}]"
            print(f"{p:>2}{m:>3}{theory.bubble_fraction(p, m):>9.1%}{med['simulator']:>10.1%}"
                  f"{med['sim+hand-off']:>10.1%}{med['hand-off ms']:>6.2f}{idle_text:>22}"
                  f"{med['p2p']:>7.1%}{med['fill/drain']:>11.1%}"
                  f"{med['host']:>7.1%}   {stages}")
            out[p, m] = med
    return out


if __name__ == "__main__":
    main()
