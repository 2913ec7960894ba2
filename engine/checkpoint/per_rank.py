"""Per-rank checkpoints, the engine's one format: every rank writes its own state, as it holds
it, and global rank 0 a manifest.

A rank of a parallel layout holds its own part of the training state: under ZeRO its shard of
the optimizer state (and at stage 3 of the parameters: no rank holds the whole model), its
tensor-parallel slices, its pipeline stage, its experts (Rajbhandari et al., ZeRO, SC 2020,
section 5; Lepikhin et al., GShard, 2020, section 2.2). Nothing is gathered: rank ``r``
writes

    rank{r}-of{W}.pt    its module's ``state_dict()`` and its optimizer's

(the composed engine passes objects with those two methods that hold the whole rank, ZeRO's
inner optimizers and where each tensor sits in the whole model: :mod:`engine.compose.resume`),
and global rank 0 writes ``manifest.json`` last, with every rank's parameter names and shapes
and the SHA-256 of every file. ``load_per_rank`` puts each rank's state back on the same
layout, bit for bit; a checkpoint of another world size or model, a missing file or a
corrupted one is a :class:`~engine.checkpoint.files.CheckpointError` naming the file and what
was expected. Offline, :func:`read_rank_state` opens any rank's file on the CPU (a file
written on a GPU too), and :mod:`engine.compose.reshard` joins every rank's into the whole
model's ``state_dict`` and cuts it for another layout. Data-parallel replicas write the same
tensors: simple, at the price of their copies on disk.

Both go through :mod:`engine.checkpoint.protocol`: files written atomically, the manifest
last, and any error of any rank, in any step, raised on every rank, naming it.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from engine.checkpoint.files import MANIFEST, CheckpointError, manifest_json, read_verified
from engine.checkpoint.protocol import FileEntry, load_files
from engine.checkpoint.snapshot import Snapshot, host_copy, save_snapshot

KIND = "per-rank"


def rank_file(rank: int, world_size: int) -> str:
    """Rank ``rank``'s file name in a checkpoint of ``world_size`` ranks."""
    return f"rank{rank}-of{world_size}.pt"


def state_layout(module: nn.Module) -> dict[str, list[int]]:
    """Every entry of ``module.state_dict()`` and its shape: what a checkpoint and a model
    must agree on."""
    return {name: list(t.shape) for name, t in module.state_dict().items()}


def save_per_rank(directory, model: nn.Module, optimizer: torch.optim.Optimizer) -> Path:
    """Every rank writes its state; global rank 0 writes the manifest last. Call on every
    rank."""
    return save_snapshot(directory, lambda: per_rank_snapshot(model, optimizer))


def per_rank_snapshot(model: nn.Module, optimizer: torch.optim.Optimizer,
                      host: bool = False) -> Snapshot:
    """This rank's part of :func:`save_per_rank`, taken now: its ``state_dict()`` and its
    optimizer's (the live tensors: ``host`` copies them into host memory, as an
    asynchronous save must)."""
    world = dist.get_world_size()

    def manifest(entries: list[FileEntry]) -> dict:
        return {"kind": KIND, "world_size": world,
                "files": {entry.name: entry.digest for entry in entries},
                "layouts": [entry.about for entry in entries]}

    payload = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    return Snapshot(rank_file(dist.get_rank(), world), host_copy(payload) if host else payload,
                    state_layout(model), manifest)


def read_rank_state(directory, rank: int) -> dict:
    """Rank ``rank``'s saved ``{"model": state_dict, "optimizer": state_dict}``, checked
    against the manifest, on the CPU. Offline: no process group needed."""
    directory = Path(directory)
    manifest = read_per_rank_manifest(directory)
    world = manifest["world_size"]
    if not 0 <= rank < world:
        raise CheckpointError(f"{directory} was saved by {world} ranks; there is no rank {rank}")
    name = rank_file(rank, world)
    return read_verified(directory / name, manifest["files"][name],
                         f"the manifest lists {world} rank files", "cpu")


def read_per_rank_manifest(directory) -> dict:
    """The manifest of the per-rank checkpoint in ``directory``, checked: a
    :class:`CheckpointError` if there is none, it is another kind's, or it is damaged."""
    directory = Path(directory)
    manifest = manifest_json(directory, KIND)
    path = directory / MANIFEST
    if manifest.get("kind") != KIND:
        raise CheckpointError(f"{path} is not a per-rank checkpoint: its kind is "
                              f"{manifest.get('kind')!r}")
    world = manifest.get("world_size")
    files, layouts = manifest.get("files"), manifest.get("layouts")
    if not (isinstance(world, int) and world >= 1 and isinstance(files, dict)
            and set(files) == {rank_file(r, world) for r in range(world)}
            and isinstance(layouts, list) and len(layouts) == world):
        raise CheckpointError(f"{path} is damaged: it should list {world!r} rank files and as "
                              "many layouts")
    return manifest


def load_per_rank(directory, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Resume from :func:`save_per_rank` on the same ranks. Call on every rank."""
    directory = Path(directory)
    rank, world = dist.get_rank(), dist.get_world_size()

    def read() -> dict:
        manifest = read_per_rank_manifest(directory)
        if manifest["world_size"] != world:
            raise CheckpointError(f"the checkpoint in {directory} was saved by "
                                  f"{manifest['world_size']} ranks and this run has {world}")
        saved, ours = manifest["layouts"][rank], state_layout(model)
        if saved != ours:
            raise CheckpointError(f"rank {rank}'s model does not match the checkpoint: "
                                  f"{_difference(saved, ours)} ({directory / MANIFEST})")
        return read_rank_state(directory, rank)

    def apply(state: dict) -> None:
        model.load_state_dict(state["model"])  # copied into the parameters, on their device
        optimizer.load_state_dict(state["optimizer"])  # moved to its parameters' device

    load_files(directory, read, apply)


def _difference(saved: dict, ours: dict) -> str:
    missing, extra = sorted(saved.keys() - ours.keys()), sorted(ours.keys() - saved.keys())
    if missing or extra:
        return f"saved but not here: {missing or 'none'}; here but not saved: {extra or 'none'}"
    name = next(k for k in saved if saved[k] != ours[k])
    return f"{name} is {tuple(saved[name])} in the checkpoint and {tuple(ours[name])} here"
