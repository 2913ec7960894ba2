"""How long a checkpoint holds the training step: ``engine train``'s synchronous save against
its asynchronous one (``--async-save``, :class:`engine.checkpoint.trainer.AsyncSaver`), measured.

A synchronous save blocks the step for the whole of it: the copy, ``torch.save``, the write and
``fsync`` of every shard, the agreements, the rename. An asynchronous one blocks it for the
copy into host memory alone (plus any wait for the previous write still running), the rest
overlapping the next steps: Nebula and ``torch.distributed.checkpoint.async_save`` do the
same, and CheckFreq (Mohan et al., FAST 2021, section 4.2) names the two phases snapshot and
persist. :func:`blocking_times` runs the real trainer both ways on each preset and returns the
seconds each save held the step, as the trainer's ranks timed them.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from engine.launch import launch
from engine.train.cli import TrainConfig, check_config
from engine.train.run import train_on_rank


def blocked_per_save(cfg: TrainConfig) -> list[float]:
    """Run ``cfg`` on ``cfg.world_size`` Gloo ranks; per save, the slowest rank's seconds
    blocked by it."""
    check_config(cfg, cfg.world_size)
    results = launch(train_on_rank, cfg.world_size, cfg, backend="gloo", quiet=True,
                     timeout=cfg.timeout)
    per_rank = [r["engine"]["save_blocked_s"] for r in results]
    return [max(times) for times in zip(*per_rank)]


def blocking_times(models=("tiny", "medium"), dp: int = 2, zero: int = 1, saves: int = 3,
                   directory=None) -> list[dict]:
    """For each preset in ``models``, DDP-style data parallelism at ``dp`` ranks with ZeRO
    stage ``zero``: ``2 (saves + 1)`` steps, a checkpoint every second step (a write has a
    step to run behind), once synchronous and once asynchronous. One row per model: the median seconds a save held the step either way
    (the first save of each run left out: it creates the files and, async, the Gloo group),
    and the ratio. ``directory``: where the checkpoints go (default: a temporary one)."""
    rows = []
    with tempfile.TemporaryDirectory(dir=directory) as root:
        for model in models:
            row = {"model": model}
            for mode in ("sync", "async"):
                cfg = TrainConfig(dp=dp, zero=zero, model=model, steps=2 * (saves + 1),
                                  save=str(Path(root, f"{model}-{mode}")), save_every=2,
                                  keep=1, async_save=mode == "async")
                blocked = blocked_per_save(cfg)[1:]
                row[f"{mode}_ms"] = statistics.median(blocked) * 1e3
            row["ratio"] = row["sync_ms"] / row["async_ms"]
            rows.append(row)
    return rows


def print_blocking_times(rows: list[dict]) -> None:
    print(f"{'model':<8} {'sync save (ms)':>15} {'async save (ms)':>16} {'sync / async':>13}")
    for r in rows:
        print(f"{r['model']:<8} {r['sync_ms']:>15.1f} {r['async_ms']:>16.1f} "
              f"{r['ratio']:>13.1f}")


if __name__ == "__main__":
    print_blocking_times(blocking_times())
