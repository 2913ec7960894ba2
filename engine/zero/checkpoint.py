"""Sharded checkpoints for ZeRO inside a dp x tp x pp mesh: every rank saves only what it owns,
and one offline step turns a part's shards back into a plain ``state_dict``.

Tensor and pipeline parallelism cut the model into ``tp x pp`` *parts*
(:class:`engine.topology.Mesh`). Each part is held by one data-parallel group, and ZeRO
shards each of the part's flat buckets over that group (Rajbhandari et al., ZeRO, SC 2020,
section 5). So each dp group saves its own part: rank ``d`` of the dp group at
tensor-parallel index ``t`` and pipeline stage ``p`` writes

    tp{t}-pp{p}-rank{d}-of{dp}.pt    (``rank{d}-of{dp}.pt`` when tp = pp = 1)

with its parameter shards, fp32 masters (where they are a separate copy: fp32 parameters are
their own masters and are not written twice), inner optimizer state and buffers. Global rank 0
then writes ``manifest.json``: the layout (dp, tp, pp), the stage, where every parameter
sits in its bucket (per part), and the SHA-256 of every file.

* ``save_sharded(directory, model, optimizer, mesh=None)``: call on every rank.
* ``load_sharded(directory, model, optimizer, mesh=None)`` resumes the same run on the same
  layout, bit for bit. A checkpoint of another layout or model, a missing file or a
  corrupted one is a :class:`CheckpointError` that names the file and what was expected.
  The ranks of a dp group agree on it before any of them waits on a collective.
* ``consolidate(directory, tp=None, pp=None)`` needs no process group. It joins the dp
  shards of one part, drops the padding and returns ``{name: tensor}`` for that part's
  module. PyTorch's distributed checkpoint has the same step, ``dcp_to_torch_save``.

* ``consolidate_optimizer(directory, tp=None, pp=None)`` does the same for the optimizer's
  state (AdamW's moments per parameter, its step count), and ``load_dense(model, optimizer,
  params, optimizer_state)`` loads such a whole state into any layout: together they re-cut a
  checkpoint for another dp, the way DeepSpeed's universal checkpoint does (its per-parameter
  fp32 "atoms"). :mod:`engine.reshard` joins the tp and pp parts of the trainer's GPT too.

``mesh`` is required when the dp group is not the whole world: only the mesh knows which
part a dp group holds.

**Collectives.** Shards only move inside their dp group, the ``group`` the optimizer or
``ZeroDataParallel`` was built with. Only the manifest, one file for the whole mesh, involves
every rank: a barrier once any old manifest is gone, and a gather of file names and digests
to global rank 0.

**Crashes.** Every file is written under a temporary name and renamed into place
(``os.replace`` is atomic). Rank 0 removes an old manifest before anyone writes, and writes
the new one last, once every shard is in place. So a directory with a manifest is a complete
checkpoint, and a save that dies midway leaves none.

**Devices.** ``torch.save`` records the device each tensor came from (``cuda:3``), and
``torch.load`` goes back there unless it gets a ``map_location``. ``consolidate`` maps
everything to the CPU, so eight GPUs' checkpoint opens on a laptop. ``load_sharded`` maps
what was saved on an accelerator to this rank's device (the one its shards live on), and
leaves what was saved on the CPU there (offloaded state, Adam's step counters).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.serialization import default_restore_location

from engine.comm import ops
from engine.validation import non_negative_int
from engine.zero.flat import ShardedBucket
from engine.zero.optimizer import ZeroOptimizer
from engine.zero.stage3 import ZeroDataParallel

MANIFEST = "manifest.json"
FORMAT = 2  # manifest version: 2 records the mesh and one bucket layout per part


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: another layout or model, a missing or corrupted file,
    or a save that did not finish."""


class MeshShape(NamedTuple):
    """The sizes of the mesh a checkpoint was cut for."""

    dp: int
    tp: int
    pp: int

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        return f"dp x tp x pp = {self.dp} x {self.tp} x {self.pp}"


class Place(NamedTuple):
    """One shard file's place: the model part (``tp``, ``pp``) and the rank in its dp group."""

    tp: int
    pp: int
    dp: int


def part_key(tp: int, pp: int) -> str:
    return f"tp{tp}-pp{pp}"


def file_name(shape: MeshShape, place: Place) -> str:
    part = "" if shape.tp == shape.pp == 1 else part_key(place.tp, place.pp) + "-"
    return f"{part}rank{place.dp}-of{shape.dp}.pt"


# -- what a ZeRO model holds ---------------------------------------------------------------


@dataclass(frozen=True)
class _Sharded:
    """A ZeRO model's checkpointable state: its sharded buckets (ZeRO-1/2's flat buckets or
    ZeRO-3's units, each with typed ``params``, ``offsets``, ``shapes``, ``padded``,
    ``shard`` and ``master``), the inner optimizer, and the data-parallel group. ``regather``:
    ZeRO-1/2 keep every parameter whole, so after a load each bucket's ``flat`` is gathered
    back from the shards."""

    module: nn.Module
    stage: int
    buckets: list[ShardedBucket]
    inner: torch.optim.Optimizer
    group: dist.ProcessGroup | None
    regather: bool

    @property
    def sharded(self) -> bool:
        return self.stage >= 1


def _sharded(model: nn.Module, optimizer) -> _Sharded:
    if isinstance(model, ZeroDataParallel):
        return _Sharded(model.module, 3, model.all_units, model.optimizer.inner, model.group,
                        regather=False)
    if isinstance(optimizer, ZeroOptimizer):
        return _Sharded(model, optimizer.stage, optimizer.buckets, optimizer.inner,
                        optimizer.group, regather=optimizer.stage >= 1)
    raise TypeError("save a ZeroDataParallel model, or a model with its ZeroOptimizer; got "
                    f"{type(model).__name__} and {type(optimizer).__name__}")


def _place(state: _Sharded, mesh) -> tuple[MeshShape, Place]:
    """This rank's mesh shape and place, from ``mesh`` or, without one, the dp group alone."""
    dp_ranks = ops.group_ranks(state.group)
    if mesh is None:
        if len(dp_ranks) != dist.get_world_size():
            raise ValueError(
                f"the optimizer's data-parallel group holds ranks {dp_ranks} of "
                f"{dist.get_world_size()}: pass mesh= (the engine.topology.Mesh it was taken "
                "from) so the checkpoint knows which tensor/pipeline part this rank saves")
        return MeshShape(len(dp_ranks), 1, 1), Place(0, 0, dist.get_rank(state.group))
    if ops.group_ranks(mesh.dp_group) != dp_ranks:
        raise ValueError(f"the mesh's data-parallel group {ops.group_ranks(mesh.dp_group)} is "
                         f"not the optimizer's {dp_ranks}: build the optimizer (or "
                         "ZeroDataParallel) with group=mesh.dp_group")
    c = mesh.coords
    return MeshShape(mesh.dp, mesh.tp, mesh.pp), Place(c.tp, c.pp, c.dp)


def _part_layout(state: _Sharded) -> dict:
    """Where every parameter sits in its bucket, under all its names (tied ones have two),
    and the buffers' shapes: what a checkpoint and a model must agree on."""
    names = _param_names(state.module)
    buckets = [{"padded": b.padded,
                "params": [{"names": names[p], "offset": b.offsets[p],
                            "shape": list(b.shapes[p])} for p in b.params]}
               for b in state.buckets]
    buffers = {name: list(v.shape) for name, v in state.module.named_buffers()}
    return {"buckets": buckets, "buffers": buffers}


# -- files ----------------------------------------------------------------------------------


def write_atomically(path: Path, data: bytes) -> None:
    """A temporary file in the same directory, then a rename: whoever looks (or crashes) sees
    the old file or the whole new one, never part of one."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _onto(device: torch.device):
    """``map_location`` for a load: tensors saved from an accelerator onto ``device``; those
    saved on the CPU stay there."""
    def restore(storage, location: str):
        return default_restore_location(storage, "cpu" if location == "cpu" else str(device))
    return restore


def read_manifest(directory) -> dict:
    """The manifest of the checkpoint in ``directory``, checked: a :class:`CheckpointError`
    if there is none (a save that did not finish) or it is unreadable."""
    return _manifest(Path(directory))


def manifest_json(directory: Path, kind: str = "sharded") -> dict:
    """``directory``'s manifest as JSON, unchecked: a :class:`CheckpointError` if there is
    none (not a ``kind`` checkpoint, or a save that did not finish) or it does not parse."""
    path = directory / MANIFEST
    if not path.exists():
        raise CheckpointError(f"{path} does not exist: not a {kind} checkpoint directory, or "
                              "a save that did not finish (the manifest is written last)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is corrupted: {e}") from None


def _manifest(directory: Path) -> dict:
    path, manifest = directory / MANIFEST, manifest_json(directory)
    missing = {"format", "mesh", "stage", "parts", "files"} - set(manifest)
    if missing or manifest["format"] != FORMAT:
        raise CheckpointError(f"{path} is not a format-{FORMAT} manifest (missing "
                              f"{sorted(missing)}, format {manifest.get('format')}): save the "
                              "checkpoint again with this version")
    return manifest


def _read(directory: Path, manifest: dict, name: str, map_location) -> dict:
    path, shape = directory / name, MeshShape(**manifest["mesh"])
    expected = f"the manifest lists {len(manifest['files'])} shard files ({shape})"
    if name not in manifest["files"]:
        raise CheckpointError(f"{path} is not in the manifest: {expected}")
    return read_verified(path, manifest["files"][name], expected, map_location)


def read_verified(path: Path, digest: str, expected: str, map_location) -> dict:
    """``torch.load`` of ``path`` once its SHA-256 equals the manifest's ``digest``; a
    :class:`CheckpointError` naming the file if it is missing (``expected``: what the
    manifest lists) or corrupted."""
    if not path.exists():
        raise CheckpointError(f"{path} is missing: {expected}")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != digest:
        raise CheckpointError(f"{path} is corrupted: its SHA-256 does not match the manifest")
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)


# -- save, load, consolidate ------------------------------------------------------------------


def save_sharded(directory, model: nn.Module, optimizer=None, mesh=None) -> Path:
    """Every rank writes its shard file; global rank 0 writes the manifest last. Call on every
    rank. ``mesh``: the :class:`engine.topology.Mesh`, needed when dp is not the world."""
    directory = Path(directory)
    state = _sharded(model, optimizer)
    shape, place = _place(state, mesh)
    payload = {"shards": [b.shard.detach().clone() for b in state.buckets],
               "masters": [None if _same_storage(b.master, b.shard) else b.master.detach().clone()
                           for b in state.buckets],
               "optimizer": state.inner.state_dict(),
               "buffers": {k: v.clone() for k, v in state.module.named_buffers()}}
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    name = file_name(shape, place)
    first = dist.get_rank() == 0
    if first:  # from here until the new manifest is in place, the directory is incomplete
        directory.mkdir(parents=True, exist_ok=True)
        (directory / MANIFEST).unlink(missing_ok=True)
    ops.barrier()  # the whole mesh: nobody writes while an old manifest could vouch for it
    write_atomically(directory / name, data)
    entry = (part_key(place.tp, place.pp), name, hashlib.sha256(data).hexdigest(),
             _part_layout(state) if place.dp == 0 else None)
    entries = [None] * dist.get_world_size() if first else None
    dist.gather_object(entry, entries, dst=0)
    if first:
        manifest = {"format": FORMAT, "mesh": shape._asdict(), "stage": state.stage,
                    "sharded": state.sharded,
                    "parts": {key: layout for key, _, _, layout in entries if layout},
                    "files": {file: digest for _, file, digest, _ in entries}}
        write_atomically(directory / MANIFEST, json.dumps(manifest, indent=1).encode())
    ops.barrier()  # every rank returns once the checkpoint is complete
    return directory


def _check_fits(directory: Path, manifest: dict, shape: MeshShape, key: str,
                state: _Sharded) -> None:
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
    ours, theirs = _part_layout(state), _saved_part(directory, manifest, key)
    if ours != theirs:
        raise CheckpointError(f"part {key} does not match this model: "
                              f"{_difference(theirs, ours)} ({directory / MANIFEST})")


def _saved_part(directory: Path, manifest: dict, key: str) -> dict:
    if key not in manifest["parts"]:
        raise CheckpointError(f"{directory / MANIFEST} has no part {key}, only "
                              f"{sorted(manifest['parts'])}")
    return manifest["parts"][key]


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


def load_sharded(directory, model: nn.Module, optimizer=None, mesh=None) -> None:
    """Resume from ``save_sharded`` on the same layout. Call on every rank (with the same
    ``mesh`` as the save)."""
    directory = Path(directory)
    state = _sharded(model, optimizer)
    shape, place = _place(state, mesh)
    payload, error = None, None
    try:
        manifest = _manifest(directory)
        _check_fits(directory, manifest, shape, part_key(place.tp, place.pp), state)
        payload = _read(directory, manifest, file_name(shape, place),
                        _onto(state.buckets[0].shard.device))
    except CheckpointError as e:
        error = e
    # the dp group agrees before its collectives, so no rank waits on one that gave up
    errors = [None] * dist.get_world_size(state.group)
    dist.all_gather_object(errors, None if error is None else str(error), group=state.group)
    if error is not None:
        raise error
    if any(errors):
        rank, message = next((r, m) for r, m in enumerate(errors) if m)
        raise CheckpointError(f"rank {rank} of this data-parallel group cannot load: {message}")
    with torch.no_grad():
        for bucket, shard, master in zip(state.buckets, payload["shards"], payload["masters"],
                                         strict=True):
            bucket.shard.copy_(shard)
            if master is not None:  # else the master is the shard itself, just loaded
                bucket.master.copy_(master)
        for name, value in state.module.named_buffers():
            value.copy_(payload["buffers"][name])
    state.inner.load_state_dict(payload["optimizer"])
    if state.regather:  # every rank's full parameters, from the loaded shards
        for b in state.buckets:
            ops.all_gather_into_tensor(b.flat, b.shard.clone(), group=state.group)


def consolidate(directory, tp: int | None = None, pp: int | None = None
                ) -> dict[str, torch.Tensor]:
    """A plain ``state_dict`` (parameters and buffers, on the CPU) of one model part: the
    part at tensor-parallel index ``tp`` and pipeline stage ``pp`` (both may be left out
    when the model is whole). Offline: no process group, any number of ranks saved it."""
    part = _read_part(directory, tp, pp)
    state = part.unflatten([payload["shards"] for payload in part.payloads])
    state.update(part.payloads[0]["buffers"])
    return state


class DenseOptimizerState(NamedTuple):
    """An optimizer's state with the shards joined, per parameter name: ``elementwise`` holds
    the tensors shaped like their parameter (AdamW's ``exp_avg``, ``exp_avg_sq``),
    ``per_bucket`` the values each flat bucket had one of (AdamW's ``step``), repeated for
    every parameter of the bucket."""

    elementwise: dict[str, dict[str, torch.Tensor]]
    per_bucket: dict[str, dict[str, torch.Tensor]]


def consolidate_optimizer(directory, tp: int | None = None, pp: int | None = None
                          ) -> DenseOptimizerState:
    """The inner optimizer's state of one model part, joined over dp like
    :func:`consolidate`'s parameters: an elementwise state tensor lies in its bucket exactly
    as the parameters do (the inner optimizer runs on the flat shards), so the same offsets
    cut it back into one tensor per parameter."""
    part = _read_part(directory, tp, pp)
    states = [payload["optimizer"]["state"] for payload in part.payloads]
    elementwise: dict[str, list] = {}
    per_bucket: dict[str, dict[str, torch.Tensor]] = {}
    for i, bucket in enumerate(part.buckets):
        for key, value in states[0].get(i, {}).items():
            if torch.is_tensor(value) and value.dim() > 0 and \
                    value.numel() == part.shard_numel(i):
                elementwise.setdefault(key, [[] for _ in part.payloads])
                continue
            for param in bucket["params"]:
                for name in param["names"]:
                    per_bucket.setdefault(key, {})[name] = torch.as_tensor(value).clone()
    joined = {key: part.unflatten([[state[i][key] for i in range(len(part.buckets))]
                                   for state in states])
              for key in elementwise}
    return DenseOptimizerState(joined, per_bucket)


@dataclass
class _Part:
    """One model part's shard files, read and checked, with the manifest's layout."""

    directory: Path
    key: str
    buckets: list[dict]
    payloads: list[dict]

    def shard_numel(self, i: int) -> int:
        return self.buckets[i]["padded"] // len(self.payloads)

    def unflatten(self, shards_per_rank: list[list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """``{name: tensor}`` from each rank's list of per-bucket shards, joined and cut at
        the manifest's offsets (a tied parameter under each of its names)."""
        state: dict[str, torch.Tensor] = {}
        for i, bucket in enumerate(self.buckets):
            flat = torch.cat([shards[i] for shards in shards_per_rank])
            if flat.numel() != bucket["padded"]:
                raise CheckpointError(f"bucket {i} of part {self.key} has {flat.numel()} "
                                      f"elements in the shards and {bucket['padded']} in the "
                                      "manifest")
            for param in bucket["params"]:
                numel = torch.Size(param["shape"]).numel()
                value = flat[param["offset"]:param["offset"] + numel].view(param["shape"])
                for name in param["names"]:
                    state[name] = value.clone()
        return state


def _read_part(directory, tp: int | None, pp: int | None) -> _Part:
    directory = Path(directory)
    manifest = _manifest(directory)
    shape = MeshShape(**manifest["mesh"])
    if tp is None and pp is None and shape.tp * shape.pp > 1:
        raise CheckpointError(f"{directory} holds {shape.tp * shape.pp} model parts (tp = "
                              f"{shape.tp}, pp = {shape.pp}): pass tp= and pp= to choose one")
    tp, pp = (0 if tp is None else tp), (0 if pp is None else pp)
    for name, value, size in (("tp", tp, shape.tp), ("pp", pp, shape.pp)):
        if non_negative_int(name, value) >= size:
            raise ValueError(f"{name}={value} is outside this checkpoint's {name} = {size}")
    ranks = range(shape.dp) if manifest["sharded"] else [0]  # unsharded: every rank has all
    payloads = [_read(directory, manifest, file_name(shape, Place(tp, pp, d)), "cpu")
                for d in ranks]
    key = part_key(tp, pp)
    return _Part(directory, key, _saved_part(directory, manifest, key)["buckets"], payloads)


# -- re-cutting: a whole state into any layout ------------------------------------------------


def load_dense(model: nn.Module, optimizer, params: dict[str, torch.Tensor],
               optimizer_state: DenseOptimizerState | None = None) -> None:
    """Load a whole state (``params``: name -> tensor, buffers included; ``optimizer_state``
    as :func:`consolidate_optimizer` returns it) into this rank's shards, whatever layout
    the state came from: each bucket is packed from the named tensors and this rank keeps
    its slice. Every rank reads the same whole state, so nothing is sent. With fp16/bf16
    parameters the fp32 masters are rebuilt from ``params``. Call on every rank."""
    state = _sharded(model, optimizer)
    names = {p: found[0] for p, found in _param_names(state.module).items()}

    def packed(b: ShardedBucket, values: dict[str, torch.Tensor], what: str) -> torch.Tensor:
        for p in b.params:
            value = values.get(names[p])
            if value is None:
                raise CheckpointError(f"the whole state has no {what} {names[p]!r}")
            if tuple(value.shape) != tuple(b.shapes[p]):
                raise CheckpointError(f"{what} {names[p]!r} is {tuple(value.shape)} in the "
                                      f"whole state and {tuple(b.shapes[p])} here")
        return b.flatten(lambda p: values[names[p]])

    with torch.no_grad():
        for b in state.buckets:
            full = packed(b, params, "parameter")
            if hasattr(b, "flat"):  # ZeRO-0/1/2 keep every parameter whole
                b.flat.copy_(full)
            else:  # ZeRO-3 keeps its slice
                b.shard.copy_(b.shard_of(full))
            if not _same_storage(b.master, b.shard):
                b.master.copy_(b.shard_of(full))
        for name, value in state.module.named_buffers():
            if name not in params or params[name].shape != value.shape:
                raise CheckpointError(f"buffer {name!r} {tuple(value.shape)} is not in the "
                                      "whole state with that shape")
            value.copy_(params[name])
    if optimizer_state is None:
        return
    loaded = {}
    for i, b in enumerate(state.buckets):
        loaded[i] = {key: b.shard_of(packed(b, values, f"optimizer state {key!r}")).float()
                     for key, values in optimizer_state.elementwise.items()}
        for key, values in optimizer_state.per_bucket.items():
            found = {float(values[names[p]]) for p in b.params if names[p] in values}
            if len(found) != 1:
                raise CheckpointError(f"optimizer state {key!r}: the parameters of one bucket "
                                      f"here ({', '.join(names[p] for p in b.params)}) have "
                                      f"{sorted(found) or 'no'} values in the whole state; "
                                      "expected one")
            loaded[i][key] = values[names[b.params[0]]].clone()
    state.inner.load_state_dict({"state": {i: s for i, s in loaded.items() if s},
                                 "param_groups": state.inner.state_dict()["param_groups"]})


def _param_names(module: nn.Module) -> dict[nn.Parameter, list[str]]:
    """Every parameter's names, in order (a tied parameter has two)."""
    names: dict[nn.Parameter, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(name)
    return names
