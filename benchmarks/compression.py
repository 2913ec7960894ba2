"""The convergence experiment of chapter 03 (issue 5): every compressor, the same training
run, bytes sent against final quality.

4 Gloo ranks train the same student MLP on a teacher-labelled task (engine.labs.compression)
for the same number of steps with the same seeds; only the compressor changes. Prints a table
(bytes per rank, fraction of dense, held-out loss and accuracy) and saves loss curves and the
bytes-vs-accuracy frontier.

    python benchmarks/compression.py [--ranks 4] [--steps 300] [--plot PATH]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tqdm.auto import tqdm

from engine import launch
from engine.labs.compression import RUNS, train_compressed
from engine.viz.compress import compression_figure


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--runs", nargs="*", default=list(RUNS))
    parser.add_argument("--plot", default="benchmarks/results/compression.png")
    args = parser.parse_args(argv)
    results = [launch(train_compressed, args.ranks, spec, args.steps, timeout=1800)[0]
               for spec in tqdm(args.runs, desc="runs")]
    print(f"{args.ranks} Gloo ranks, {args.steps} steps of momentum SGD, student MLP on a "
          "teacher-labelled 10-class task")
    print(f"{'compressor':<18} {'MB sent/rank':>12} {'of dense':>9} {'test loss':>10} "
          f"{'accuracy':>9}")
    for r in results:
        print(f"{r['spec']:<18} {r['bytes_sent'] / 2**20:>12.2f} "
              f"{r['bytes_sent'] / r['dense_bytes']:>9.2%} {r['test_loss']:>10.3f} "
              f"{r['accuracy']:>9.1%}")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        compression_figure(results).savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")
    return results


if __name__ == "__main__":
    main()
