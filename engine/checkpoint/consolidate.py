"""Offline consolidation: a sharded checkpoint's part back to a plain ``state_dict``, and its
optimizer's state back to one tensor per parameter. No process group; any number of ranks
may have saved it.

* :func:`consolidate` joins the dp shards of one part (:mod:`engine.checkpoint.sharded`),
  drops the padding and returns ``{name: tensor}`` for that part's module, on the CPU (so
  eight GPUs' checkpoint opens on a laptop). PyTorch's distributed checkpoint has the same
  step, ``dcp_to_torch_save``.
* :func:`consolidate_optimizer` does the same for the inner optimizer's state (AdamW's
  moments per parameter, its step count). With :func:`engine.zero.recut.load_dense`, which
  loads such a whole state into any layout, it re-cuts a checkpoint for another dp, the way
  DeepSpeed's universal checkpoint does (its per-parameter fp32 "atoms");
  :mod:`engine.compose.reshard` joins every part of the trainer's GPT (tp, pp, ep) too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from engine.checkpoint.files import CheckpointError
from engine.checkpoint.sharded import (MeshShape, Place, file_name, part_key, read_manifest,
                                       read_shard, saved_part)
from engine.validation import non_negative_int


def consolidate(directory, tp: int | None = None, pp: int | None = None
                ) -> dict[str, torch.Tensor]:
    """A plain ``state_dict`` (parameters and buffers, on the CPU) of one model part: the
    part at tensor-parallel index ``tp`` and pipeline stage ``pp`` (both may be left out
    when the model is whole). Offline: no process group, any number of ranks saved it."""
    part = read_part(directory, tp, pp)
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
    part = read_part(directory, tp, pp)
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
class Part:
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


def read_part(directory, tp: int | None, pp: int | None) -> Part:
    """Every shard file of part (``tp``, ``pp``), read on the CPU and checked."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    shape = MeshShape(**manifest["mesh"])
    if tp is None and pp is None and shape.tp * shape.pp > 1:
        raise CheckpointError(f"{directory} holds {shape.tp * shape.pp} model parts (tp = "
                              f"{shape.tp}, pp = {shape.pp}): pass tp= and pp= to choose one")
    tp, pp = (0 if tp is None else tp), (0 if pp is None else pp)
    for name, value, size in (("tp", tp, shape.tp), ("pp", pp, shape.pp)):
        if non_negative_int(name, value) >= size:
            raise ValueError(f"{name}={value} is outside this checkpoint's {name} = {size}")
    ranks = range(shape.dp) if manifest["sharded"] else [0]  # unsharded: every rank has all
    payloads = [read_shard(directory, manifest, file_name(shape, Place(tp, pp, d)), "cpu")
                for d in ranks]
    key = part_key(tp, pp)
    return Part(directory, key, saved_part(directory, manifest, key)["buckets"], payloads)
