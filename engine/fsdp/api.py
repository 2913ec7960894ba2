"""``fully_shard`` and ``full_state_dict``: FSDP2's user-facing calls, from scratch.

``fully_shard(block)`` on each block, then ``fully_shard(model)`` on the root (which takes the
parameters no block took: embeddings, final norm): every parameter becomes its local dim-0
shard (:mod:`engine.fsdp.shard`), so ``model.parameters()`` are the shards and any
``torch.optim`` optimizer steps them, its state sharded with them. What FSDP1 did with one flat
parameter per unit (:mod:`engine.zero.stage3`, the flat buckets), FSDP2 does per parameter:
each keeps its name, shape (on dims 1..), dtype and ``requires_grad``, which is what lets it
compose with tensor parallelism (a TP shard sharded again on dim 0), freeze some parameters,
and save checkpoints without flat-parameter surgery.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine.comm import ops
from engine.fsdp.group import ShardGroup
from engine.fsdp.policy import MixedPrecisionPolicy


def fully_shard(module: nn.Module, group=None, *, reshard_after_forward: bool = True,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                ignored_params=()) -> nn.Module:
    """Shard ``module``'s parameters (those no sharded child took) over ``group`` on dim 0;
    gather them around its forward and backward. Returns ``module``, changed in place.
    ``ignored_params`` stay as they are, neither sharded nor reduced (PyTorch's
    ``ignored_params``: e.g. experts that differ across ranks, reduced over another group)."""
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy={mp_policy!r}: expected an engine.fsdp.MixedPrecisionPolicy")
    if getattr(module, "fsdp_state", None) is not None:
        raise ValueError(f"fully_shard({type(module).__name__}): this module is already "
                         "sharded (it has an fsdp_state); shard each module once, children "
                         "first, then the root")
    owned = {id(p.shard) for sub in module.modules()
             if getattr(sub, "fsdp_state", None) is not None for p in sub.fsdp_state.params}
    taken = [name for name, p in module.named_parameters()
             if hasattr(p, "fsdp_layout") and id(p) not in owned]
    if taken:
        raise ValueError(f"fully_shard({type(module).__name__}): its parameters {taken[:3]} "
                         "are already sharded by a fully_shard call on a module around it; "
                         "shard children first, then the root (as PyTorch's FSDP2 requires)")
    module.fsdp_state = ShardGroup(module, group, reshard_after_forward, mp_policy,
                                   frozenset(id(p) for p in ignored_params))
    return module


def gather_full(param: torch.Tensor, group=None, tensor: torch.Tensor | None = None
                ) -> torch.Tensor:
    """A sharded parameter whole, in its own dtype (or ``tensor``, shaped as the shard, e.g.
    its gradient, whole); a parameter ``fully_shard`` did not touch, as it is (a copy)."""
    tensor = param if tensor is None else tensor
    layout = getattr(param, "fsdp_layout", None)
    if layout is None:
        return tensor.detach().clone()
    n = dist.get_world_size(group)
    send = layout.padded(tensor.detach())
    received = torch.empty(n * send.numel(), dtype=send.dtype, device=send.device)
    ops.all_gather_into_tensor(received, send, group=group)
    return layout.unpad(received).clone()


def full_state_dict(module: nn.Module, group=None) -> dict[str, torch.Tensor]:
    """Every parameter of ``module`` and its children, whole, by name (a collective: every rank
    of ``group`` calls it)."""
    return {name: gather_full(p, group) for name, p in module.named_parameters()}
