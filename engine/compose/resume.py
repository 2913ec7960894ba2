"""What one rank of a composed layout must save to resume bit for bit, for every layout.

A composed rank holds a different part of the training state in each layout: its pipeline
stage's blocks, its tensor-parallel slices, its experts, under ZeRO-1/2 its shard of the
optimizer state (Rajbhandari et al. 2020, section 5), under ZeRO-3 its shard of the
parameters themselves, under ``--compress`` the compressor's error-feedback memory (Seide et
al. 2014; Karimireddy et al. 2019, Algorithm 2: the residual is part of the state, a restart
without it changes every later step). Rather than gathering any of it, each rank writes its
own part, whole (:mod:`engine.checkpoint.per_rank`, through the agreed protocol of
:mod:`engine.checkpoint.protocol`: a failing rank leaves no half checkpoint), split in two
objects with ``state_dict()`` / ``load_state_dict()``:

* :class:`RankTensors` (the per-rank file's ``"model"``): the model's ``state_dict()`` (under
  ZeRO-3 the parameters are their dim-0 shards, :mod:`engine.fsdp`); and any tensor an
  optimizer updates that shares no storage with those (a separate fp32 master copy);
* :class:`RankOptimizerState` (``"optimizer"``): every inner optimizer's ``state_dict()`` (a
  plain AdamW, each :class:`engine.zero.ZeroOptimizer`'s shard optimizer, ZeRO-3's, the dense
  and the experts' under expert parallelism), the compressor's state with its spec, and the
  placement of every tensor of both (:func:`placement`, below).

A run resumed from them on the same layout continues bit for bit (tests/test_compose_resume.py).
Beside its state each rank records, without any communication, where every tensor of it sits
in the dense GPT (:func:`placement`: the dense name, this rank's tensor-parallel index, and for
a ZeRO shard the bucket's offsets and the ranks whose shards make it whole), as PyTorch's
distributed checkpoint records each tensor's placement: what lets
:mod:`engine.compose.reshard` join the files offline into one dense state and cut it for
another layout (``--reshard``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from engine.checkpoint.files import CheckpointError
from engine.comm import ops
from engine.compose.experts import Optimizers
from engine.compose.parallelize import Parallel
from engine.compose.state import global_expert_name
from engine.zero import ZeroOptimizer


def inner_optimizers(par: Parallel) -> list:
    """The torch optimizers holding this rank's state (inside ZeRO's wrappers)."""
    outer = par.optimizer
    parts = outer.optimizers if isinstance(outer, Optimizers) else (outer,)
    return [getattr(part, "inner", part) for part in parts]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class RankTensors:
    """This rank's parameters and buffers, named, as they live (module docstring)."""

    def __init__(self, par: Parallel):
        self.par = par

    def state_dict(self) -> dict[str, torch.Tensor]:
        found = dict(self.par.model.state_dict())  # ZeRO-3: the parameters are the shards
        held = {_storage(t) for t in found.values()}
        for i, inner in enumerate(inner_optimizers(self.par)):
            for j, p in enumerate(p for group in inner.param_groups for p in group["params"]):
                if _storage(p) not in held:  # a separate master copy
                    found[f"master.{i}.{j}"] = p.detach()
        return found

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        ours = self.state_dict()
        if ours.keys() != state.keys():
            raise CheckpointError(f"this rank holds {sorted(ours)[:4]}..., the checkpoint "
                                  f"{sorted(state)[:4]}...: another layout")
        for name, tensor in ours.items():
            tensor.copy_(state[name])


def compressor_state(compressor) -> dict:
    """What a compressor keeps between steps, in plain containers: its dicts of tensors
    (residuals, warm starts), counters, and its random generators' states."""
    state = {}
    for name, value in (vars(compressor) if compressor is not None else {}).items():
        if isinstance(value, torch.Generator):
            state[name] = {"torch_generator": value.get_state()}
        elif isinstance(value, np.random.RandomState):
            kind, keys, pos, gauss, cached = value.get_state()
            state[name] = {"numpy_random": [kind, torch.from_numpy(keys.astype(np.int64)), pos,
                                            gauss, cached]}  # uint32 keys: int64 tensors
        elif isinstance(value, (dict, int, float)):
            state[name] = value
    return state


def restore_compressor(compressor, state: dict, device: torch.device) -> None:
    for name, value in state.items():
        current = getattr(compressor, name)
        if isinstance(current, torch.Generator):
            current.set_state(value["torch_generator"])
        elif isinstance(current, np.random.RandomState):
            kind, keys, pos, gauss, cached = value["numpy_random"]
            current.set_state((kind, keys.numpy().astype(np.uint32), pos, gauss, cached))
        elif isinstance(current, dict):
            setattr(compressor, name, {k: v.to(device) if isinstance(v, torch.Tensor) else v
                                       for k, v in value.items()})
        else:
            setattr(compressor, name, value)


class RankOptimizerState:
    """This rank's optimizer states and its compressor's (module docstring)."""

    def __init__(self, par: Parallel):
        self.par = par
        self.compressor = par.compressing.compressor if par.compressing else None

    def state_dict(self) -> dict:
        return {"optimizers": [inner.state_dict() for inner in inner_optimizers(self.par)],
                "compress": self.par.plan.compress or "none",
                "compressor": compressor_state(self.compressor),
                "placement": placement(self.par)}

    def load_state_dict(self, state: dict) -> None:
        ours, spec = inner_optimizers(self.par), self.par.plan.compress or "none"
        if not {"optimizers", "compress", "compressor"} <= state.keys():
            raise CheckpointError(f"the checkpoint's optimizer part has {sorted(state)}, not a "
                                  "composed rank's optimizers and compressor: saved before "
                                  "engine.compose.resume existed, or by another strategy")
        if state["compress"] != spec or len(state["optimizers"]) != len(ours):
            raise CheckpointError(f"the checkpoint was saved with --compress "
                                  f"{state['compress']} and {len(state['optimizers'])} "
                                  f"optimizer(s); this run has --compress {spec} and "
                                  f"{len(ours)}")
        for inner, saved in zip(ours, state["optimizers"], strict=True):
            inner.load_state_dict(saved)
        device = next(iter(self.par.model.parameters())).device
        restore_compressor(self.compressor, state["compressor"], device)


def rank_state(par: Parallel) -> tuple[RankTensors, RankOptimizerState]:
    """``(model side, optimizer side)`` of this rank, what a per-rank checkpoint saves."""
    return RankTensors(par), RankOptimizerState(par)


def placement(par: Parallel) -> dict:
    """Where each tensor of this rank's saved state sits in the dense GPT (module docstring),
    in plain containers: ``tp_rank`` and ``tp`` (this rank's tensor-parallel index and degree)
    and ``tensors``, one entry per dense name and kind (``"param"`` or an optimizer state's
    key, e.g. ``"exp_avg"``): its ``path`` in the saved ``{"model", "optimizer"}``; a 0-dim
    state (AdamW's ``step``) has ``scalar``; a ZeRO-1/2 shard has ``flat``: the ``ranks``
    whose shards, joined in that order, are the bucket, and this tensor's ``offset`` and
    ``shape`` in it; a ZeRO-3 shard has ``rows``: the ``ranks`` whose shards, joined on dim 0
    in that order, are the tensor, and its ``shape``. Local: no communication."""
    names: dict[int, list[str]] = {}
    for name, p in par.model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(global_expert_name(name, par))
    entries: list[dict] = []

    def add(p, what: str, path: list, **where) -> None:
        entries.extend({"name": name, "what": what, "path": path, **where}
                       for name in names[id(p)])

    buckets = {}  # id(what an inner optimizer updates) -> (its ZeRO bucket, the shards' ranks)
    parts = par.optimizer.optimizers if isinstance(par.optimizer, Optimizers) else \
        (par.optimizer,)
    for part in parts:
        if isinstance(part, ZeroOptimizer):
            buckets.update({id(b.master): (b, _shard_ranks(b, part.group))
                            for b in part.buckets})
    for name, p in par.model.named_parameters(remove_duplicate=False):
        entries.append({"name": global_expert_name(name, par), "what": "param",
                        "path": ["model", name], **_rows_place(p, par)})
    for i, inner in enumerate(inner_optimizers(par)):
        params = [p for group in inner.param_groups for p in group["params"]]
        for j, q in enumerate(params):
            for key, value in inner.state.get(q, {}).items():
                if not torch.is_tensor(value):
                    continue
                path = ["optimizer", "optimizers", i, "state", j, key]
                bucket, ranks = buckets.get(id(q), (None, None))
                for p in bucket.params if bucket is not None else (q,):
                    if value.dim() == 0:
                        add(p, key, path, scalar=True)
                    elif bucket is None:
                        add(p, key, path, **_rows_place(q, par))
                    else:
                        add(p, key, path, flat=_flat_place(bucket, p, ranks))
    return {"tp_rank": par.mesh.coords.tp, "tp": par.mesh.tp, "tensors": entries}


def _shard_ranks(bucket, group) -> list[int]:
    """The global ranks whose shards of ``bucket``, joined in this order, make it whole."""
    return list(ops.group_ranks(group)) if bucket.world_size > 1 else [dist.get_rank()]


def _rows_place(p, par: Parallel) -> dict:
    """A ZeRO-3 shard's place (:mod:`engine.fsdp`): ``rows``, the ranks whose shards, joined
    on dim 0 in this order, are the parameter (nothing for a parameter held whole)."""
    if not hasattr(p, "fsdp_layout"):
        return {}
    return {"rows": {"ranks": _shard_ranks(p.fsdp_layout, par.mesh.dp_cp_group),
                     "shape": list(p.fsdp_layout.shape)}}


def _flat_place(bucket, p, ranks: list[int]) -> dict:
    return {"ranks": ranks, "offset": bucket.offsets[p], "shape": list(bucket.shapes[p]),
            "padded": bucket.padded}
