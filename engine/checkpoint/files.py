"""Checkpoint files: written atomically, read back verified against the manifest's SHA-256.

The bottom of every checkpoint in the engine (the per-rank ones, the trainer's): the disk
alone, no process group.

* :func:`write_atomically` writes under a temporary name in the same directory, syncs, then
  renames into place (``os.replace`` is atomic on one filesystem): whoever looks, or
  crashes, sees the old file or the whole new one. A write that fails removes its temporary
  file, so it leaves nothing behind, not even half a file under another name.
* :func:`sha256` is the digest a manifest records of every file, and :func:`read_verified`
  checks it before ``torch.load`` sees a byte (``weights_only=True``: tensors and plain
  containers, never code).
* :data:`MANIFEST` is written last by every save (:mod:`engine.checkpoint.protocol`), so a
  directory holds a complete checkpoint exactly when it holds a manifest;
  :func:`manifest_json` reads one, or says which save did not finish.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import torch

MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used or made: another layout or model, a missing or
    corrupted file, a save that did not finish, or any error of any rank during a save or a
    load (:mod:`engine.checkpoint.protocol`), named by its rank."""


def sha256(data: bytes) -> str:
    """The hex SHA-256 of ``data``: what a manifest records of each file."""
    return hashlib.sha256(data).hexdigest()


def serialised(state) -> bytes:
    """``state`` (tensors in plain containers) as the bytes ``torch.save`` writes."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def write_atomically(path: Path, data: bytes) -> None:
    """A temporary file in the same directory, then a rename: whoever looks (or crashes) sees
    the old file or the whole new one, never part of one. On an error the temporary file is
    removed and the error raised."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def read_verified(path: Path, digest: str, expected: str, map_location) -> dict:
    """``torch.load`` of ``path`` once its SHA-256 equals the manifest's ``digest``; a
    :class:`CheckpointError` naming the file if it is missing (``expected``: what the
    manifest lists) or corrupted."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} is missing: {expected}")
    data = path.read_bytes()
    if sha256(data) != digest:
        raise CheckpointError(f"{path} is corrupted: its SHA-256 does not match the manifest")
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)


def manifest_json(directory: Path, kind: str) -> dict:
    """``directory``'s manifest as JSON, unchecked: a :class:`CheckpointError` if there is
    none (not a ``kind`` checkpoint, or a save that did not finish) or it does not parse."""
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise CheckpointError(f"{path} does not exist: not a {kind} checkpoint directory, or "
                              "a save that did not finish (the manifest is written last)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is corrupted: {e}") from None


def write_json(path: Path, record: dict) -> None:
    """``record`` as indented JSON, written atomically (a manifest, ``trainer.json``)."""
    write_atomically(path, json.dumps(record, indent=1).encode())

