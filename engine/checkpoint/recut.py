"""Re-cutting: a whole state (every parameter whole, its optimizer state per parameter) loaded
into this rank's ZeRO-0/1/2 buckets, whatever layout the state came from.

:mod:`engine.compose.reshard` joins a per-rank checkpoint's files into such a state offline
(every parameter and its AdamW moments under one process's names, the way DeepSpeed's universal
checkpoint keeps per-parameter fp32 "atoms") and cuts it for another layout (tp, pp, cp, ep);
this module is its last step for a :class:`~engine.zero.optimizer.ZeroOptimizer`: each flat
bucket packed from the named tensors, and this rank's slice of it kept. It reads ZeRO's
buckets, so it sits in the strategies' layer (tests/test_structure.py), as
:mod:`engine.checkpoint.trainer` does: the rest of :mod:`engine.checkpoint` imports neither.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from engine.checkpoint.files import CheckpointError
from engine.zero.flat import ShardedBucket
from engine.zero.optimizer import ZeroOptimizer


class DenseOptimizerState(NamedTuple):
    """An optimizer's state per parameter name: ``elementwise`` holds the tensors shaped like
    their parameter (AdamW's ``exp_avg``, ``exp_avg_sq``), ``per_bucket`` the values each flat
    bucket has one of (AdamW's ``step``), given for every parameter of the bucket."""

    elementwise: dict[str, dict[str, torch.Tensor]]
    per_bucket: dict[str, dict[str, torch.Tensor]]


def param_names(module: nn.Module) -> dict[nn.Parameter, list[str]]:
    """Every parameter's names, in order (a tied parameter has two)."""
    names: dict[nn.Parameter, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(name)
    return names


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share memory: fp32 parameters are their own masters."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def load_dense(model: nn.Module, optimizer: ZeroOptimizer, params: dict[str, torch.Tensor],
               optimizer_state: DenseOptimizerState | None = None) -> None:
    """Load a whole state (``params``: name -> tensor, buffers included; ``optimizer_state``
    per parameter name) into ``optimizer``'s buckets over ``model``'s parameters, whatever
    layout the state came from: each bucket is packed from the named tensors (ZeRO-0/1/2 keep
    every parameter whole) and this rank keeps its slice of the optimizer state. Every rank
    reads the same whole state, so nothing is sent. With fp16/bf16 parameters the fp32 masters
    are rebuilt from ``params``. Call on every rank."""
    if not isinstance(optimizer, ZeroOptimizer):
        raise TypeError(f"load_dense re-cuts a ZeroOptimizer's buckets; got "
                        f"{type(optimizer).__name__}")
    names = {p: found[0] for p, found in param_names(model).items()}

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
        for b in optimizer.buckets:
            full = packed(b, params, "parameter")
            b.flat.copy_(full)
            if not same_storage(b.master, b.shard):
                b.master.copy_(b.shard_of(full))
        for name, value in model.named_buffers():
            if name not in params or params[name].shape != value.shape:
                raise CheckpointError(f"buffer {name!r} {tuple(value.shape)} is not in the "
                                      "whole state with that shape")
            value.copy_(params[name])
    if optimizer_state is None:
        return
    loaded = {}
    for i, b in enumerate(optimizer.buckets):
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
    inner = optimizer.inner
    inner.load_state_dict({"state": {i: s for i, s in loaded.items() if s},
                           "param_groups": inner.state_dict()["param_groups"]})
