"""Re-cutting: a whole state (every parameter whole, its optimizer state per parameter) loaded
into this rank's ZeRO buckets, whatever layout the state came from.

With :func:`engine.checkpoint.consolidate.consolidate_optimizer`, which joins a checkpoint's
shards into such a state offline, this re-cuts a checkpoint for another dp, the way
DeepSpeed's universal checkpoint does (its per-parameter fp32 "atoms"); :mod:`engine.compose.
reshard` joins and re-cuts every part of the trainer's GPT (tp, pp, cp, ep) with it.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.checkpoint.consolidate import DenseOptimizerState
from engine.checkpoint.files import CheckpointError
from engine.zero.flat import ShardedBucket
from engine.zero.sharded_state import param_names, same_storage, sharded_state


def load_dense(model: nn.Module, optimizer, params: dict[str, torch.Tensor],
               optimizer_state: DenseOptimizerState | None = None) -> None:
    """Load a whole state (``params``: name -> tensor, buffers included; ``optimizer_state``
    as :func:`~engine.checkpoint.consolidate.consolidate_optimizer` returns it) into this
    rank's shards, whatever layout the state came from: each bucket is packed from the named
    tensors and this rank keeps its slice. Every rank reads the same whole state, so nothing
    is sent. With fp16/bf16 parameters the fp32 masters are rebuilt from ``params``. Call on
    every rank."""
    state = sharded_state(model, optimizer)
    names = {p: found[0] for p, found in param_names(state.module).items()}

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
            if not same_storage(b.master, b.shard):
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
