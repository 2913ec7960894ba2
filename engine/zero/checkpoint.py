"""Sharded checkpoints for ZeRO: every rank saves only what it owns; one offline step turns the
shards back into a plain ``state_dict``.

``save_sharded(directory, model, optimizer)`` writes ``rank{r}-of{N}.pt`` per rank (its
parameter shards, fp32 masters and inner optimizer state) and a ``manifest.json`` with the
world size, the stage, the layout and a SHA-256 of every file. ``load_sharded`` resumes the
same run on the same number of ranks, bit for bit. ``consolidate(directory)`` needs no
process group: it concatenates the shards of every bucket, drops the padding and returns
``{name: tensor}`` that ``load_state_dict`` of the unwrapped model accepts, on any world size
(PyTorch's distributed checkpoint does the same with ``dcp_to_torch_save``).
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
from engine.zero.optimizer import ZeroOptimizer
from engine.zero.stage3 import ZeroDataParallel


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: wrong world size, missing or corrupted file."""


def _parts(model: nn.Module, optimizer):
    """``(module, stage, parts, inner optimizer, sharded)``; a part is one flat bucket:
    ``(params, offsets, shapes, padded, shard, master)``."""
    if isinstance(model, ZeroDataParallel):
        units = [(u.params, u.offsets, u.shapes, u.padded, u.shard, u.master)
                 for u in model.all_units]
        return model.module, 3, units, model.optimizer.inner, True
    if isinstance(optimizer, ZeroOptimizer):
        buckets = [(b.params, b.offsets, {p: p.shape for p in b.params}, b.padded, b.shard, m)
                   for b, m in zip(optimizer.buckets, optimizer.masters, strict=True)]
        return model, optimizer.stage, buckets, optimizer.inner, optimizer.stage >= 1
    raise TypeError("save a ZeroDataParallel model, or a model with its ZeroOptimizer; got "
                    f"{type(model).__name__} and {type(optimizer).__name__}")


def _layout(module: nn.Module, parts) -> list[dict]:
    """Where every parameter sits in its bucket, under all its names (tied ones have two)."""
    names: dict[nn.Parameter, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(name)
    return [{"padded": padded,
             "params": [{"names": names[p], "offset": offsets[p], "shape": list(shapes[p])}
                        for p in params]}
            for params, offsets, shapes, padded, _, _ in parts]


def save_sharded(directory, model: nn.Module, optimizer=None) -> Path:
    """Every rank writes its shard; rank 0 writes the manifest. Call on every rank."""
    directory = Path(directory)
    module, stage, parts, inner, sharded = _parts(model, optimizer)
    rank, n = dist.get_rank(), dist.get_world_size()
    payload = {"shards": [part[4].detach().clone() for part in parts],
               "masters": [master.detach().clone() for *_, master in parts],
               "optimizer": inner.state_dict(),
               "buffers": {k: v.clone() for k, v in module.named_buffers()}}
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    name = f"rank{rank}-of{n}.pt"
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    (directory / name).write_bytes(data)
    digests = [None] * n
    dist.all_gather_object(digests, (name, hashlib.sha256(data).hexdigest()))
    if rank == 0:
        manifest = {"world_size": n, "stage": stage, "sharded": sharded,
                    "layout": _layout(module, parts), "files": dict(digests)}
        (directory / "manifest.json").write_text(json.dumps(manifest, indent=1))
    dist.barrier()
    return directory


def _manifest(directory: Path) -> dict:
    path = directory / "manifest.json"
    if not path.exists():
        raise CheckpointError(f"{path} does not exist: not a sharded checkpoint directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is corrupted: {e}") from None


def _read(directory: Path, manifest: dict, rank: int) -> dict:
    name = f"rank{rank}-of{manifest['world_size']}.pt"
    path = directory / name
    if not path.exists():
        raise CheckpointError(f"{path} is missing: the checkpoint has {manifest['world_size']} "
                              "shard files")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != manifest["files"][name]:
        raise CheckpointError(f"{path} is corrupted: its SHA-256 does not match the manifest")
    return torch.load(io.BytesIO(data), weights_only=True)


def load_sharded(directory, model: nn.Module, optimizer=None) -> None:
    """Resume from ``save_sharded`` on the same number of ranks. Call on every rank."""
    directory = Path(directory)
    manifest = _manifest(directory)
    n = dist.get_world_size()
    module, stage, parts, inner, _ = _parts(model, optimizer)
    if manifest["world_size"] != n:
        raise CheckpointError(
            f"the checkpoint in {directory} was saved by {manifest['world_size']} ranks and "
            f"this run has {n}; shards only fit the world size they were cut for. Use "
            "consolidate() for a plain state_dict and start from it")
    if manifest["stage"] != stage:
        raise CheckpointError(f"the checkpoint was saved at stage {manifest['stage']}, this "
                              f"run is at stage {stage}")
    payload = _read(directory, manifest, dist.get_rank())
    with torch.no_grad():
        for (*_, shard, master), saved, saved_master in zip(
                parts, payload["shards"], payload["masters"], strict=True):
            shard.copy_(saved)
            master.copy_(saved_master)
        for name, value in module.named_buffers():
            value.copy_(payload["buffers"][name])
    inner.load_state_dict(payload["optimizer"])
    if isinstance(optimizer, ZeroOptimizer) and stage >= 1:
        for b in optimizer.buckets:  # every rank's full parameters from the loaded shards
            ops.all_gather_into_tensor(b.flat, b.shard.clone())


def consolidate(directory) -> dict[str, torch.Tensor]:
    """A plain ``state_dict`` (parameters and buffers) from a sharded checkpoint. Offline: no
    process group needed, any number of ranks saved it."""
    directory = Path(directory)
    manifest = _manifest(directory)
    ranks = range(manifest["world_size"]) if manifest["sharded"] else [0]
    payloads = [_read(directory, manifest, r) for r in ranks]
    state: dict[str, torch.Tensor] = {}
    for i, bucket in enumerate(manifest["layout"]):
        flat = torch.cat([payload["shards"][i] for payload in payloads])
        if flat.numel() != bucket["padded"]:
            raise CheckpointError(f"bucket {i} has {flat.numel()} elements in the shards and "
                                  f"{bucket['padded']} in the manifest")
        for param in bucket["params"]:
            numel = torch.Size(param["shape"]).numel()
            value = flat[param["offset"]:param["offset"] + numel].view(param["shape"]).clone()
            for name in param["names"]:
                state[name] = value
    state.update(payloads[0]["buffers"])
    return state
