"""Per-rank checkpoints: every rank writes its own model and optimizer state, whole.

For strategies whose ranks hold *different* parameters but shard none of them, as expert
parallelism does: in each MoE layer a rank holds the experts of its expert-parallel slot and
the dense weights whole (Lepikhin et al., GShard, 2020, section 2.2). ZeRO's flat-bucket
checkpoints (:mod:`engine.zero.checkpoint`) do not apply, and there is nothing to join: rank
``r`` writes

    rank{r}-of{W}.pt    its module's ``state_dict()`` and its optimizer's

and global rank 0 writes ``manifest.json`` last, with every rank's parameter names and shapes
and the SHA-256 of every file. ``load_per_rank`` puts each rank's state back, bit for bit;
a checkpoint of another world size or model, a missing file or a corrupted one is a
:class:`~engine.zero.checkpoint.CheckpointError` naming the file and what was expected, and
every rank learns of any rank's error before training goes on. Data-parallel replicas write
the same dense weights: simple, at the price of ``W`` copies of them on disk.

Files are written atomically, as ZeRO's are (temporary name, then rename), and the manifest
last, so a directory with a manifest is a complete checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from engine.comm import ops
from engine.zero.checkpoint import (MANIFEST, CheckpointError, manifest_json, read_verified,
                                    write_atomically)

KIND = "per-rank"


def _file(rank: int, world_size: int) -> str:
    return f"rank{rank}-of{world_size}.pt"


def _layout(module: nn.Module) -> dict[str, list[int]]:
    return {name: list(t.shape) for name, t in module.state_dict().items()}


def save_per_rank(directory, model: nn.Module, optimizer: torch.optim.Optimizer) -> Path:
    """Every rank writes its state; global rank 0 writes the manifest last. Call on every
    rank."""
    directory = Path(directory)
    rank, world = dist.get_rank(), dist.get_world_size()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    data = buffer.getvalue()
    if rank == 0:  # from here until the new manifest is in place, the directory is incomplete
        directory.mkdir(parents=True, exist_ok=True)
        (directory / MANIFEST).unlink(missing_ok=True)
    ops.barrier()
    path, failure = directory / _file(rank, world), None
    try:
        write_atomically(path, data)
    except OSError as e:  # a full disk on one rank: every rank hears of it, none waits
        failure = f"rank {rank} could not write {path}: {e}"
    entries = [None] * world
    dist.all_gather_object(entries, (hashlib.sha256(data).hexdigest(), _layout(model), failure))
    failures = [f for _, _, f in entries if f]
    if failures:
        raise CheckpointError("; ".join(failures) + " (no manifest written: the checkpoint "
                              "is incomplete)")
    if rank == 0:
        manifest = {"kind": KIND, "world_size": world,
                    "files": {_file(r, world): digest for r, (digest, _, _) in
                              enumerate(entries)},
                    "layouts": [layout for _, layout, _ in entries]}
        write_atomically(directory / MANIFEST, json.dumps(manifest, indent=1).encode())
    ops.barrier()
    return directory


def read_rank_state(directory, rank: int) -> dict:
    """Rank ``rank``'s saved ``{"model": state_dict, "optimizer": state_dict}``, checked
    against the manifest, on the CPU. Offline: no process group needed."""
    directory = Path(directory)
    manifest = _manifest(directory)
    world = manifest["world_size"]
    if not 0 <= rank < world:
        raise CheckpointError(f"{directory} was saved by {world} ranks; there is no rank {rank}")
    name = _file(rank, world)
    return read_verified(directory / name, manifest["files"][name],
                         f"the manifest lists {world} rank files", "cpu")


def _manifest(directory: Path) -> dict:
    manifest = manifest_json(directory, KIND)
    path = directory / MANIFEST
    if manifest.get("kind") != KIND:
        raise CheckpointError(f"{path} is not a per-rank checkpoint (a ZeRO checkpoint? load "
                              "it with engine.zero.load_sharded)")
    world = manifest.get("world_size")
    files, layouts = manifest.get("files"), manifest.get("layouts")
    if not (isinstance(world, int) and world >= 1 and isinstance(files, dict)
            and set(files) == {_file(r, world) for r in range(world)}
            and isinstance(layouts, list) and len(layouts) == world):
        raise CheckpointError(f"{path} is damaged: it should list {world!r} rank files and as "
                              "many layouts")
    return manifest


def load_per_rank(directory, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Resume from :func:`save_per_rank` on the same ranks. Call on every rank."""
    directory = Path(directory)
    rank, world = dist.get_rank(), dist.get_world_size()
    error = None
    try:
        manifest = _manifest(directory)
        if manifest["world_size"] != world:
            raise CheckpointError(f"the checkpoint in {directory} was saved by "
                                  f"{manifest['world_size']} ranks and this run has {world}")
        saved, ours = manifest["layouts"][rank], _layout(model)
        if saved != ours:
            raise CheckpointError(f"rank {rank}'s model does not match the checkpoint: "
                                  f"{_difference(saved, ours)} ({directory / MANIFEST})")
        state = read_rank_state(directory, rank)
        model.load_state_dict(state["model"])  # copied into the parameters, on their device
        optimizer.load_state_dict(state["optimizer"])  # moved to its parameters' device
    except CheckpointError as e:
        error = e
    except Exception as e:  # noqa: BLE001  anything else one rank meets: all must hear of it
        error = CheckpointError(f"rank {rank} could not load {directory}: "
                                f"{type(e).__name__}: {e}")
    errors = [None] * world  # every rank learns of any rank's error before training goes on
    dist.all_gather_object(errors, None if error is None else str(error))
    if error is not None:
        raise error
    if any(errors):
        failed, message = next((r, m) for r, m in enumerate(errors) if m)
        raise CheckpointError(f"rank {failed} cannot load: {message}")


def _difference(saved: dict, ours: dict) -> str:
    missing, extra = sorted(saved.keys() - ours.keys()), sorted(ours.keys() - saved.keys())
    if missing or extra:
        return f"saved but not here: {missing or 'none'}; here but not saved: {extra or 'none'}"
    name = next(k for k in saved if saved[k] != ours[k])
    return f"{name} is {tuple(saved[name])} in the checkpoint and {tuple(ours[name])} here"
