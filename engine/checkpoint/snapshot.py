"""A rank's checkpoint state taken now and written later: the split an asynchronous save needs.

A save is two jobs of different cost. The **snapshot** copies what this rank must keep (its
shards, the optimizer state, the buffers) into memory the training no longer touches: after it
the next step may change every parameter. The **write** serialises that copy, writes it
atomically and agrees with the other ranks (:func:`engine.checkpoint.protocol.save_files`).
A synchronous save does both while the step waits; an asynchronous one (Nebula, PyTorch's
``torch.distributed.checkpoint.async_save``; CheckFreq, Mohan et al., FAST 2021, section 4.2)
blocks the step only for the snapshot, to host memory, and runs the write in a background
thread.

* :class:`Snapshot`: the file name, the payload (tensors in plain containers), what the
  manifest records of it, and the function that builds the manifest from every rank's entry.
* :func:`host_copy`: a deep copy of a payload onto the CPU, so a later step that changes a
  parameter in place changes nothing in the snapshot (``state_dict()`` returns the live
  tensors, not copies).
* :func:`save_snapshot`: the write, through the agreed save protocol, on any process group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, NamedTuple

import torch

from engine.checkpoint.files import serialised
from engine.checkpoint.protocol import Agreement, FileEntry, RankFile, save_files


class Snapshot(NamedTuple):
    """One rank's part of a checkpoint, taken: ``name`` its file, ``payload`` what it holds,
    ``about`` what the manifest records of it, ``manifest`` every rank's entries -> the
    manifest (used on global rank 0)."""

    name: str
    payload: object
    about: object
    manifest: Callable[[list[FileEntry]], dict]


def host_copy(value):
    """``value`` with every tensor copied onto the CPU (a new tensor even when it is there),
    inside dicts, lists and tuples; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: host_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(host_copy(v) for v in value)
    return value


def snapshot_bytes(value) -> int:
    """The bytes of every tensor in a payload: the host memory a snapshot holds."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(snapshot_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(snapshot_bytes(v) for v in value)
    return 0


def save_snapshot(directory, snapshot: Snapshot | Callable[[], Snapshot], group=None) -> Path:
    """Write ``snapshot`` into ``directory`` by the save protocol, agreeing on ``group``
    (default: the world). Call on every rank with its own snapshot, or with the function that
    takes it: then it is taken inside the protocol's first agreement, so a rank that cannot
    take it (a model that is not sharded) is named on every rank and no rank writes."""
    taken: list[Snapshot] = []

    def prepare() -> RankFile:
        taken.append(snapshot() if callable(snapshot) else snapshot)
        return RankFile(taken[0].name, serialised(taken[0].payload), taken[0].about)

    return save_files(directory, prepare, lambda entries: taken[0].manifest(entries),
                      group=group)


def take_agreed(directory, take: Callable[[], Snapshot]) -> Snapshot:
    """``take()`` on every rank, agreed on the world (one tiny all-gather): a rank that cannot
    take its snapshot is named on every rank, and none goes on to write. Call on every
    rank."""
    with Agreement("save", directory):
        taken = take()
    return taken
