"""Sharded checkpoints for ZeRO inside a dp x tp x pp mesh: every rank saves only what it owns.

Tensor and pipeline parallelism cut the model into ``tp x pp`` *parts*
(:class:`engine.topology.Mesh`). Each part is held by one data-parallel group, and ZeRO
shards each of the part's flat buckets over that group (Rajbhandari et al., ZeRO, SC 2020,
section 5). So each dp group saves its own part: each rank writes one file
(:mod:`engine.checkpoint.sharded` names it) with its parameter shards, fp32 masters (where
they are a separate copy: fp32 parameters are their own masters and are not written twice),
inner optimizer state and buffers. Global rank 0 then writes ``manifest.json``: the layout
(dp, tp, pp), the stage, where every parameter sits in its bucket (per part), and the SHA-256
of every file.

* ``save_sharded(directory, model, optimizer, mesh=None)``: call on every rank.
* ``load_sharded(directory, model, optimizer, mesh=None)`` resumes the same run on the same
  layout, bit for bit. A checkpoint of another layout or model, a missing file or a
  corrupted one is a :class:`~engine.checkpoint.files.CheckpointError` that names the file
  and what was expected.
* Offline, with no process group: ``consolidate`` and ``consolidate_optimizer``
  (:mod:`engine.checkpoint.consolidate`) join a part's shards into a plain ``state_dict`` and
  per-parameter optimizer state; ``load_dense`` (:mod:`engine.zero.recut`) loads such a
  whole state into any layout. (Importable from here too, as before.)

``mesh`` is required when the dp group is not the whole world: only the mesh knows which
part a dp group holds.

**The protocol.** Both go through :mod:`engine.checkpoint.protocol`: every rank serialises,
then writes its file atomically, then rank 0 writes the manifest last, and after each step
every rank of the mesh agrees (one tiny all-gather) that every rank's step worked. Any error
on any rank (a full disk, a failed ``torch.save``, a corrupted file, a model that does not
fit) is raised on every rank as a ``CheckpointError`` naming that rank, at once, and a save
that fails leaves no manifest: a directory with a manifest is a complete checkpoint. A load
changes no model unless every rank could read its file. Shards only move inside their dp
group (ZeRO-1/2's full parameters are gathered back from the loaded shards).

**Devices.** ``torch.save`` records the device each tensor came from (``cuda:3``), and
``torch.load`` goes back there unless it gets a ``map_location``. ``consolidate`` maps
everything to the CPU, so eight GPUs' checkpoint opens on a laptop. ``load_sharded`` maps
what was saved on an accelerator to this rank's device (the one its shards live on), and
leaves what was saved on the CPU there (offloaded state, Adam's step counters).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from engine.checkpoint.consolidate import (DenseOptimizerState, consolidate,
                                           consolidate_optimizer)
from engine.checkpoint.files import (MANIFEST, CheckpointError, manifest_json, onto,
                                     read_verified, write_atomically)
from engine.checkpoint.protocol import FileEntry, load_files
from engine.checkpoint.snapshot import Snapshot, host_copy, save_snapshot
from engine.checkpoint.sharded import (FORMAT, MeshShape, Place, file_name, part_key,
                                       read_manifest, read_shard, saved_part)
from engine.comm import ops
from engine.zero.recut import load_dense
from engine.zero.sharded_state import (ShardedState, mesh_place, part_layout, same_storage,
                                       sharded_state)

# the names this module has always offered, now defined in engine.checkpoint / engine.zero.recut
__all__ = ["save_sharded", "load_sharded", "consolidate", "consolidate_optimizer",
           "DenseOptimizerState", "load_dense", "CheckpointError", "MANIFEST", "FORMAT",
           "MeshShape", "Place", "part_key", "file_name", "read_manifest", "manifest_json",
           "read_verified", "write_atomically"]


class PartRecord(NamedTuple):
    """What a rank's manifest entry records: the mesh, the stage, its part, and the part's
    layout (from the part's dp rank 0 only: the others hold the same part)."""

    shape: MeshShape
    stage: int
    sharded: bool
    part: str
    layout: dict | None


def save_sharded(directory, model: nn.Module, optimizer=None, mesh=None) -> Path:
    """Every rank writes its shard file; global rank 0 writes the manifest last. Call on every
    rank. ``mesh``: the :class:`engine.topology.Mesh`, needed when dp is not the world."""
    return save_snapshot(directory, lambda: sharded_snapshot(model, optimizer, mesh))


def sharded_snapshot(model: nn.Module, optimizer=None, mesh=None, host: bool = False
                     ) -> Snapshot:
    """This rank's part of :func:`save_sharded`, taken now (written later by
    :func:`engine.checkpoint.snapshot.save_snapshot`): copies of its shards, masters,
    optimizer state and buffers, on their device, or all in host memory with ``host``."""
    state = sharded_state(model, optimizer)
    shape, place = mesh_place(state, mesh)
    payload = {"shards": [b.shard.detach().clone() for b in state.buckets],
               "masters": [None if same_storage(b.master, b.shard)
                           else b.master.detach().clone() for b in state.buckets],
               "optimizer": state.inner.state_dict(),
               "buffers": {k: v.clone() for k, v in state.module.named_buffers()}}
    if host:  # the optimizer's state_dict() holds its live tensors: copied here
        payload = host_copy(payload)
    record = PartRecord(shape, state.stage, state.sharded, part_key(place.tp, place.pp),
                        part_layout(state) if place.dp == 0 else None)
    return Snapshot(file_name(shape, place), payload, record, _manifest)


def _manifest(entries: list[FileEntry]) -> dict:
    first: PartRecord = entries[0].about
    return {"format": FORMAT, "mesh": first.shape._asdict(), "stage": first.stage,
            "sharded": first.sharded,
            "parts": {e.about.part: e.about.layout for e in entries if e.about.layout},
            "files": {e.name: e.digest for e in entries}}


def load_sharded(directory, model: nn.Module, optimizer=None, mesh=None) -> None:
    """Resume from ``save_sharded`` on the same layout. Call on every rank (with the same
    ``mesh`` as the save)."""
    directory = Path(directory)
    state = None

    def read() -> dict:
        nonlocal state
        state = sharded_state(model, optimizer)
        shape, place = mesh_place(state, mesh)
        manifest = read_manifest(directory)
        _check_fits(directory, manifest, shape, part_key(place.tp, place.pp), state)
        return read_shard(directory, manifest, file_name(shape, place),
                          onto(state.buckets[0].shard.device))

    def apply(payload: dict) -> None:
        with torch.no_grad():
            for bucket, shard, master in zip(state.buckets, payload["shards"],
                                             payload["masters"], strict=True):
                bucket.shard.copy_(shard)
                if master is not None:  # else the master is the shard itself, just loaded
                    bucket.master.copy_(master)
            for name, value in state.module.named_buffers():
                value.copy_(payload["buffers"][name])
        state.inner.load_state_dict(payload["optimizer"])

    load_files(directory, read, apply)
    if state.regather:  # every rank's full parameters, from the loaded shards
        for b in state.buckets:
            ops.all_gather_into_tensor(b.flat, b.shard.clone(), group=state.group)


def _check_fits(directory: Path, manifest: dict, shape: MeshShape, key: str,
                state: ShardedState) -> None:
    saved = MeshShape(**manifest["mesh"])
    if saved != shape:
        raise CheckpointError(
            f"the checkpoint in {directory} was saved by {saved.world_size} ranks and this run "
            f"has {shape.world_size}, laid out {saved} then and {shape.dp} x {shape.tp} x "
            f"{shape.pp} now; shards only fit the layout they were cut for. Use "
            "consolidate() for a plain state_dict of each part and start from it")
    if manifest["stage"] != state.stage:
        raise CheckpointError(f"the checkpoint was saved at stage {manifest['stage']}, this "
                              f"run is at stage {state.stage}")
    ours, theirs = part_layout(state), saved_part(directory, manifest, key)
    if ours != theirs:
        raise CheckpointError(f"part {key} does not match this model: "
                              f"{_difference(theirs, ours)} ({directory / MANIFEST})")


def _difference(saved: dict, ours: dict) -> str:
    if len(saved["buckets"]) != len(ours["buckets"]):
        return (f"{len(saved['buckets'])} buckets in the checkpoint, {len(ours['buckets'])} "
                "here (another model, or another bucket_cap_mb)")
    for i, (a, b) in enumerate(zip(saved["buckets"], ours["buckets"])):
        if a != b:
            return f"bucket {i} holds {_describe(a)} in the checkpoint, {_describe(b)} here"
    return f"buffers {saved['buffers']} in the checkpoint, {ours['buffers']} here"


def _describe(bucket: dict) -> str:
    params = ", ".join(f"{p['names'][0]} {tuple(p['shape'])} at {p['offset']}"
                       for p in bucket["params"])
    return f"[{params}] padded to {bucket['padded']}"
