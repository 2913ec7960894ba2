"""The checkpoint protocol: how the ranks save and load together, and how a failure on one rank
reaches every rank.

A save or a load is a few local steps (serialise, write, read and verify, apply), each taken
by every rank at once. Each step is followed by an **agreement** (:class:`Agreement`): one
``all_gather_object`` of every rank's status, ok or the error it met. The step runs under
``try``/``except``, so a rank whose step raised still reaches the agreement: no rank waits on
one that gave up. All of them learn of it in the same tiny collective, a few milliseconds
after the failure, and all raise a :class:`~engine.checkpoint.files.CheckpointError` naming
the rank and the cause. Every process lives on, its process group usable for the next
collective. PyTorch's distributed checkpoint wraps its steps the same way
(``torch.distributed.checkpoint.utils._DistWrapper``: every rank's exception gathered, one
``CheckpointException`` raised everywhere).

**Save** (:func:`save_files`), every rank writing one file, the manifest last::

    1. serialise this rank's state                                                       agree
    2. rank 0 makes the directory and removes an old manifest                            agree
    3. write this rank's file atomically                                                 agree,
       sharing its name, SHA-256 and layout
    4. rank 0 writes the manifest                                                        agree

The manifest exists only once every file is in place, and a save that fails at any step
leaves none: never a directory that looks complete. A save that fails in step 1 (a rank
cannot serialise) leaves the directory as it was: an earlier checkpoint there stays whole.

**Load** (:func:`load_files`)::

    1. read this rank's file, verify it against the manifest, deserialise it              agree
    2. apply it to the model and the optimizer                                           agree

So no rank changes its model unless every rank could read its file. A failure in step 2 (a
rank that read its state but cannot apply it) is raised on every rank too, but the ranks that
applied theirs have changed: load again, or restart.

The agreements span the whole world (every rank calls a save or a load): a checkpoint that
one part of the mesh cannot use is one the run cannot resume from.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, NamedTuple, TypeVar

import torch.distributed as dist

from engine.checkpoint.files import (MANIFEST, CheckpointError, sha256, write_atomically,
                                     write_json)

T = TypeVar("T")


class Agreement:
    """One agreed step: ``with Agreement("save", directory) as step: ...`` runs the block on
    this rank, then every rank learns whether every rank's block worked. Set ``step.share``
    inside the block to tell the others something small (a file's digest); after the block
    ``step.shared`` holds every rank's, in rank order.

    If any rank's block raised, every rank raises a :class:`CheckpointError`: the rank that
    failed its own (named by its rank, the original as its cause), the others one naming each
    failed rank and its message. Only ``Exception`` is caught: ``KeyboardInterrupt`` and
    ``SystemExit`` take the process down, and the launcher the run."""

    def __init__(self, action: str, directory, group=None):
        self.action, self.directory, self.group = action, Path(directory), group
        self.share = None
        self.shared: list = []

    def __enter__(self) -> Agreement:
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if error is not None and not isinstance(error, Exception):
            return False
        rank = dist.get_rank()
        mine = None if error is None else self.own_error(error, rank)
        statuses = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(statuses, (rank, None if mine is None else str(mine),
                                          self.share), group=self.group)
        if mine is not None:
            if mine is error:
                return False  # this rank's own CheckpointError, raised as it is
            raise mine from error
        failed = [(r, message) for r, message, _ in statuses if message is not None]
        if failed:
            raise CheckpointError("; ".join(f"rank {r} cannot {self.action}: {message}"
                                            for r, message in failed))
        self.shared = [share for _, _, share in statuses]
        return False

    def own_error(self, error: Exception, rank: int) -> CheckpointError:
        """This rank's error as the :class:`CheckpointError` it raises: one that already names
        this rank as it is; any other named, with its type when it is not a
        ``CheckpointError`` (``OSError: [Errno 28] No space left on device``)."""
        if isinstance(error, CheckpointError):
            if re.match(rf"rank {rank}\b", str(error)):
                return error
            cause = str(error)
        else:
            cause = f"{type(error).__name__}: {error}"
        return CheckpointError(f"rank {rank} could not {self.action} {self.directory}: "
                               f"{cause}")


class RankFile(NamedTuple):
    """What one rank saves: its file's ``name``, its bytes, and what the manifest should
    record about it (a layout), or None."""

    name: str
    data: bytes
    about: object = None


class FileEntry(NamedTuple):
    """What a rank tells the others once its file is written: the file's name, its SHA-256,
    and its :class:`RankFile`'s ``about``."""

    name: str
    digest: str
    about: object


def save_files(directory, prepare: Callable[[], RankFile],
               manifest: Callable[[list[FileEntry]], dict], group=None) -> Path:
    """The save protocol (see the module): every rank writes the file ``prepare()`` returns
    into ``directory``; global rank 0 then writes ``manifest(entries)``, every rank's
    :class:`FileEntry` in rank order. Call on every rank; returns once the checkpoint is
    complete, or raises on every rank. ``group``: the process group the agreements use
    (default: the world's); an asynchronous save (:class:`engine.checkpoint.trainer.AsyncSaver`)
    agrees on a group of its own, so its thread never shares one with the training."""
    directory = Path(directory)
    first = dist.get_rank() == 0
    with Agreement("save", directory, group):  # a rank that cannot serialise leaves the old one be
        mine = prepare()
    with Agreement("save", directory, group):  # nobody writes while an old manifest could vouch
        if first:  # from here until the new manifest is in place, the directory is incomplete
            directory.mkdir(parents=True, exist_ok=True)
            (directory / MANIFEST).unlink(missing_ok=True)
    with Agreement("save", directory, group) as written:
        write_atomically(directory / mine.name, mine.data)
        written.share = FileEntry(mine.name, sha256(mine.data), mine.about)
    with Agreement("save", directory, group):  # every rank returns once the checkpoint is complete
        if first:
            write_json(directory / MANIFEST, manifest(written.shared))
    return directory


def load_files(directory, read: Callable[[], T], apply: Callable[[T], None]) -> None:
    """The load protocol (see the module): ``read()`` this rank's state (checked against the
    manifest), and once every rank has, ``apply`` it. Call on every rank."""
    with Agreement("load", directory):
        state = read()
    with Agreement("load", directory):
        apply(state)


def finish_on_first(directory, step: Callable[[], None], action: str = "save",
                    group=None) -> None:
    """``step()`` on global rank 0 alone (renaming a finished checkpoint into place), agreed
    on ``group`` (default: the world): every rank returns once it is done, or raises if it
    failed. Call on every rank."""
    with Agreement(action, directory, group):
        if dist.get_rank() == 0:
            step()
