"""A training run's checkpoints: ``engine train --save DIR --save-every K --keep N --resume``.

``DIR`` holds one directory per checkpoint, named by the number of optimizer steps done::

    DIR/step-00000004/   manifest.json, trainer.json, one shard file per rank
    DIR/step-00000006/

Each is a sharded checkpoint of :mod:`engine.zero.checkpoint` (every rank writes only what it
owns; expert parallelism's ranks, which shard nothing but hold different experts, write
per-rank checkpoints of :mod:`engine.checkpoint.per_rank`) plus ``trainer.json``: the step,
the configuration that shapes the training, and the loss of every step so far, so a resumed
run prints the whole curve. Both follow :mod:`engine.checkpoint.protocol`, and so does the
last step here (``trainer.json`` and the rename): any error on any rank, in any step of a
save or a load, is raised on every rank as a :class:`~engine.checkpoint.files.CheckpointError`
naming that rank, at once, and the training processes stay alive to report it.

**Atomic.** A checkpoint is written under a temporary name (``DIR/.step-00000006.tmp``) and
renamed into place by global rank 0 once every shard, the manifest and ``trainer.json`` are
written (``os.replace`` of a directory is atomic on one filesystem). So a crash mid-save
leaves only a temporary directory, which :func:`latest` ignores and the next save removes:
a ``step-*`` directory is always complete. Only the newest ``keep`` are kept.

On several nodes ``DIR`` must be one filesystem every node sees (NFS, Lustre): each rank
writes its own shard there and rank 0 renames the whole.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch.distributed as dist

from engine.checkpoint.files import MANIFEST, CheckpointError, write_json
from engine.checkpoint.per_rank import load_per_rank, save_per_rank
from engine.checkpoint.protocol import finish_on_first
from engine.zero.checkpoint import load_sharded, save_sharded

TRAINER = "trainer.json"
_STEP = re.compile(r"step-(\d{8})")


def step_dir(root, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def complete(root) -> list[Path]:
    """The complete checkpoints under ``root``, oldest first (a missing ``root``: none)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP.fullmatch(p.name) and p.is_dir()
             and (p / MANIFEST).exists() and (p / TRAINER).exists()]
    return sorted(found, key=lambda p: int(_STEP.fullmatch(p.name).group(1)))


def latest(root) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    found = complete(root)
    return found[-1] if found else None


def read_trainer(path) -> dict:
    """A checkpoint's ``trainer.json``: step, configuration, losses so far."""
    file = Path(path) / TRAINER
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{file} does not exist: not a checkpoint of engine train, or "
                              "a save that did not finish") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is corrupted: {e}") from None


def save(root, step: int, strategy, trainer: dict, keep: int) -> Path:
    """Write checkpoint ``step`` of ``strategy`` (an :class:`engine.strategy.Strategy`) under
    ``root``; ``trainer``: what ``trainer.json`` records besides the step. Keeps the newest
    ``keep``. Call on every rank; returns once the checkpoint is in place."""
    final = step_dir(root, step)
    temporary = final.with_name(f".{final.name}.tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(temporary, ignore_errors=True)  # a save that died before
    # each save lines every rank up before anyone writes, and again once all is written
    if strategy.per_rank_checkpoint:
        save_per_rank(temporary, strategy.model, strategy.optimizer)
    else:
        save_sharded(temporary, strategy.model, strategy.optimizer, mesh=strategy.mesh)

    def finish() -> None:  # on rank 0; every rank returns once it is done, or raises
        write_json(temporary / TRAINER, {"step": step, **trainer})
        if final.exists():  # the same step saved before a restart: replace it whole
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        temporary.rename(final)
        _prune(Path(root), keep)

    finish_on_first(temporary, finish)
    return final


def _prune(root: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` complete checkpoints, and what dead saves left."""
    for old in complete(root)[:-keep]:
        shutil.rmtree(old)
    for leftover in root.glob(".step-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def load(path, strategy) -> None:
    """Load checkpoint ``path`` into ``strategy``, on the layout it was saved with. Call on
    every rank."""
    if strategy.per_rank_checkpoint:
        load_per_rank(path, strategy.model, strategy.optimizer)
    else:
        load_sharded(path, strategy.model, strategy.optimizer, mesh=strategy.mesh)
