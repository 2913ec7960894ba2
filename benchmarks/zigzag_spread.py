"""The zig-zag speed-up of causal ring attention, measured with its spread: warm-up passes
discarded, then repeated passes, each timing every rank of both layouts, the median and the
spread of each printed beside the FLOP ratio.

Chapter 09 times each rank's share of the ring's forward arithmetic once
(:func:`engine.cp.balance.rank_seconds`, one rank after another on one thread) and prints one
ratio, the busiest contiguous rank over the busiest zig-zag rank. One such ratio moves from
run to run (the machine's other work, its caches, the clock's frequency); this script shows by
how much. Each pass times every rank of both layouts once, the two layouts alternating which
goes first; the speed-up of a pass is its busiest contiguous rank's time over its busiest
zig-zag rank's. The FLOP ratio (whole blocks, :func:`engine.cp.balance.rank_flops`) and the
critical path's (:func:`engine.cp.balance.critical_path`, with and without a kernel that skips
the masked half of a block) are counts: they do not move.

    python benchmarks/zigzag_spread.py [--n 4] [--seq 2048] [--heads 4] [--head-dim 32]
                                       [--warmup 3] [--repeats 20]

Read the spread before the median: on a machine busy with other jobs the passes disagree, and
a single pass (what a notebook prints) can land anywhere in that range.
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine.cp.balance import critical_path, rank_flops, rank_seconds

LAYOUTS = ("contiguous", "zigzag")


def one_pass(seq: int, n: int, heads: int, head_dim: int, first: str) -> dict[str, float]:
    """The busiest rank's seconds of each layout, ``first`` timed first."""
    return {layout: max(seconds) for layout, seconds in
            rank_pass(seq, n, heads, head_dim, first).items()}


def rank_pass(seq: int, n: int, heads: int, head_dim: int,
              first: str) -> dict[str, list[float]]:
    """Every rank's seconds of each layout, ``first`` timed first."""
    order = (first, *(layout for layout in LAYOUTS if layout != first))
    return {layout: rank_seconds(seq, n, layout, heads=heads, head_dim=head_dim, repeats=1)
            for layout in order}


def spread(values: list[float], unit: str, scale: float = 1.0) -> str:
    """``median [p10, p90] (min, max)`` of ``values`` times ``scale``, in ``unit`` (the
    deciles interpolated, ``statistics.quantiles``' inclusive method)."""
    v = [x * scale for x in values]
    deciles = statistics.quantiles(v, n=10, method="inclusive") if len(v) > 1 else [v[0]] * 9
    return (f"median {statistics.median(v):.2f}{unit} [p10 {deciles[0]:.2f}{unit}, "
            f"p90 {deciles[-1]:.2f}{unit}] (min {min(v):.2f}{unit}, max {max(v):.2f}{unit})")


def measure(seq: int, n: int, heads: int, head_dim: int, warmup: int,
            repeats: int) -> dict[str, list[float]]:
    """``{"contiguous": [...], "zigzag": [...], "speedup": [...], "per_flop": [...]}`` over
    ``repeats`` passes, after ``warmup`` passes whose times are discarded. ``per_flop``: the
    contiguous layout's seconds per counted FLOP over the zig-zag's, all ranks together (1
    when the two layouts' blocks run at the same speed)."""
    for i in range(warmup):
        one_pass(seq, n, heads, head_dim, LAYOUTS[i % 2])
    total = {layout: sum(rank_flops(seq, n, layout)) for layout in LAYOUTS}
    out: dict[str, list[float]] = {"contiguous": [], "zigzag": [], "speedup": [],
                                   "per_flop": []}
    for i in range(repeats):
        seconds = rank_pass(seq, n, heads, head_dim, LAYOUTS[i % 2])
        for layout in LAYOUTS:
            out[layout].append(max(seconds[layout]))
        out["speedup"].append(out["contiguous"][-1] / out["zigzag"][-1])
        rate = {layout: sum(seconds[layout]) / total[layout] for layout in LAYOUTS}
        out["per_flop"].append(rate["contiguous"] / rate["zigzag"])
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4, help="ring size (context-parallel ranks)")
    parser.add_argument("--seq", type=int, default=2048, help="sequence length, S")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3, help="passes timed and discarded")
    parser.add_argument("--repeats", type=int, default=20, help="passes timed and kept")
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.repeats < 1:
        parser.error(f"--warmup must be >= 0 and --repeats >= 1, got {args.warmup} and "
                     f"{args.repeats}")
    started = time.perf_counter()
    times = measure(args.seq, args.n, args.heads, args.head_dim, args.warmup, args.repeats)
    print(f"causal ring attention, N = {args.n}, S = {args.seq}, {args.heads} heads x "
          f"{args.head_dim}, forward block arithmetic per rank on one thread; "
          f"{args.warmup} warm-up pass(es) discarded, {args.repeats} timed")
    for layout in LAYOUTS:
        print(f"  {layout:<11} busiest rank: {spread(times[layout], ' ms', 1e3)}")
    print(f"  speed-up (busiest contiguous / busiest zig-zag, per pass): "
          f"{spread(times['speedup'], 'x')}")
    print(f"  seconds per counted FLOP, all ranks, contiguous / zig-zag (1 = blocks equally "
          f"fast): {spread(times['per_flop'], 'x')}")
    flops = {layout: max(rank_flops(args.seq, args.n, layout)) for layout in LAYOUTS}
    whole = {layout: critical_path(args.seq, args.n, layout) for layout in LAYOUTS}
    kernel = {layout: critical_path(args.seq, args.n, layout, skip_masked=True)
              for layout in LAYOUTS}
    print(f"  counted: busiest rank's FLOPs {flops['contiguous'] / flops['zigzag']:.3f}x "
          f"(4N/(2N+1) = {4 * args.n / (2 * args.n + 1):.3f}); critical path "
          f"{whole['contiguous'] / whole['zigzag']:.3f}x with whole blocks, "
          f"{kernel['contiguous'] / kernel['zigzag']:.3f}x skipping masked halves "
          f"(2 - 1/N = {2 - 1 / args.n:.3f} as S grows)")
    print(f"  ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
