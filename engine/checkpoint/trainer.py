"""A training run's checkpoints: ``engine train --save DIR --save-every K --keep N --resume``.

``DIR`` holds one directory per checkpoint, named by the number of optimizer steps done::

    DIR/step-00000004/   manifest.json, trainer.json, one file per rank (rankR-ofW.pt)
    DIR/step-00000006/

Each is a per-rank checkpoint of :mod:`engine.checkpoint.per_rank` (every rank writes its own
whole state: the composed engine's stage, slices, experts, ZeRO shards and compressor memory,
:mod:`engine.compose.resume`, with where each tensor sits in the dense GPT, so
:mod:`engine.compose.reshard` can re-cut it) plus ``trainer.json``: the step,
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

**Asynchronous** (``--async-save``, :class:`AsyncSaver`): the step waits only for a copy of
the state in host memory; the same write then runs in a background thread, and a crash
during it leaves the previous checkpoint the newest complete one.

On several nodes ``DIR`` must be one filesystem every node sees (NFS, Lustre): each rank
writes its own shard there and rank 0 renames the whole.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from pathlib import Path

import torch.distributed as dist

from engine.checkpoint.files import MANIFEST, CheckpointError, write_json
from engine.checkpoint.per_rank import load_per_rank, per_rank_snapshot
from engine.checkpoint.protocol import finish_on_first
from engine.checkpoint.snapshot import Snapshot, save_snapshot, take_agreed

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
    """Write checkpoint ``step`` of ``strategy`` (an :class:`engine.train.strategy.Strategy`) under
    ``root``; ``trainer``: what ``trainer.json`` records besides the step. Keeps the newest
    ``keep``. Call on every rank; returns once the checkpoint is in place."""
    return write(root, step, lambda: snapshot(strategy), trainer, keep)


def snapshot(strategy, host: bool = False) -> Snapshot:
    """This rank's part of a checkpoint of ``strategy``, taken now (copied into host memory
    with ``host``): what :func:`write` writes."""
    return per_rank_snapshot(*per_rank_parts(strategy), host=host)


def per_rank_parts(strategy) -> tuple:
    """What a per-rank checkpoint of ``strategy`` saves: its ``rank_state`` where it has one
    (the composed engine's whole rank, :mod:`engine.compose.resume`), else its model and
    optimizer."""
    return strategy.rank_state or (strategy.model, strategy.optimizer)


def write(root, step: int, taken, trainer: dict, keep: int, group=None) -> Path:
    """Write checkpoint ``step`` from ``taken`` (this rank's :class:`Snapshot`, or the
    function that takes it) under ``root``, atomically, keeping the newest ``keep``; the
    ranks agree on ``group`` (default: the world). Call on every rank."""
    final = step_dir(root, step)
    temporary = final.with_name(f".{final.name}.tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(temporary, ignore_errors=True)  # a save that died before
    # each save lines every rank up before anyone writes, and again once all is written
    save_snapshot(temporary, taken, group=group)

    def finish() -> None:  # on rank 0; every rank returns once it is done, or raises
        write_json(temporary / TRAINER, {"step": step, **trainer})
        if final.exists():  # the same step saved before a restart: replace it whole
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        temporary.rename(final)
        _prune(Path(root), keep)

    finish_on_first(temporary, finish, group=group)
    return final


class AsyncSaver:
    """``engine train --save DIR --async-save``: each save blocks the step only while this rank
    copies its state into host memory (:func:`snapshot` with ``host``); a background thread
    then writes it by the same protocol as :func:`save` (files written atomically, the
    manifest, ``trainer.json``, the rename into ``step-NNNNNNNN``), agreeing on a Gloo group
    of its own, so that its collectives never interleave with the training's on the world's.

    One write at a time: a save first waits for the previous write (so at most one snapshot
    sits in host memory) and :meth:`wait` (at the end of training) for the last. A write's
    error is raised there, on every rank. A crash during a write leaves only the temporary
    directory, so the previous checkpoint stays the newest complete one (:func:`latest`).

    ``blocked_s``: for each save, the seconds the step was held (waiting for the previous
    write, then the snapshot); ``written_s``: each background write's seconds."""

    def __init__(self):
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.group = None
        self.blocked_s: list[float] = []
        self.written_s: list[float] = []

    def save(self, root, step: int, strategy, trainer: dict, keep: int) -> None:
        """Snapshot ``strategy`` now, write checkpoint ``step`` in the background. Call on
        every rank, at the same step."""
        start = time.perf_counter()
        self.wait()
        if self.group is None:  # every rank creates it here, at the same save; a Gloo side
            # channel of the whole world for the background write, no axis of the Mesh
            self.group = dist.new_group(backend="gloo")
        temporary = step_dir(root, step).with_name(f".step-{step:08d}.tmp")
        taken = take_agreed(temporary, lambda: snapshot(strategy, host=True))
        self.blocked_s.append(time.perf_counter() - start)
        self.thread = threading.Thread(target=self._write, name=f"checkpoint-{step}",
                                       args=(root, step, taken, dict(trainer), keep),
                                       daemon=True)
        self.thread.start()

    def _write(self, root, step: int, taken: Snapshot, trainer: dict, keep: int) -> None:
        start = time.perf_counter()
        try:
            write(root, step, taken, trainer, keep, group=self.group)
        except BaseException as e:  # raised in the training thread, by wait()
            self.error = e
        self.written_s.append(time.perf_counter() - start)

    def wait(self) -> None:
        """Return once the last write is done; raise its error if it failed."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def _prune(root: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` complete checkpoints, and what dead saves left."""
    for old in complete(root)[:-keep]:
        shutil.rmtree(old)
    for leftover in root.glob(".step-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def load(path, strategy) -> None:
    """Load checkpoint ``path`` into ``strategy``, on the layout it was saved with. Call on
    every rank."""
    load_per_rank(path, *per_rank_parts(strategy))
