"""What a ZeRO model holds, as its checkpoints see it: the sharded buckets, the inner
optimizer, the data-parallel group, and where the rank sits in the mesh.

ZeRO-1/2 (:class:`~engine.zero.optimizer.ZeroOptimizer`) and ZeRO-3
(:class:`~engine.zero.stage3.ZeroDataParallel`) keep their state differently; this module
presents both the same way to the sharded save and load (:mod:`engine.zero.checkpoint`) and to
the re-cutting of a whole state into buckets (:mod:`engine.zero.recut`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from engine.checkpoint.sharded import MeshShape, Place
from engine.comm import ops
from engine.zero.flat import ShardedBucket
from engine.zero.optimizer import ZeroOptimizer
from engine.zero.stage3 import ZeroDataParallel


@dataclass(frozen=True)
class ShardedState:
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


def sharded_state(model: nn.Module, optimizer) -> ShardedState:
    """``model``'s state: a :class:`ZeroDataParallel` model, or a model with its
    :class:`ZeroOptimizer` (``optimizer``)."""
    if isinstance(model, ZeroDataParallel):
        return ShardedState(model.module, 3, model.all_units, model.optimizer.inner,
                            model.group, regather=False)
    if isinstance(optimizer, ZeroOptimizer):
        return ShardedState(model, optimizer.stage, optimizer.buckets, optimizer.inner,
                            optimizer.group, regather=optimizer.stage >= 1)
    raise TypeError("save a ZeroDataParallel model, or a model with its ZeroOptimizer; got "
                    f"{type(model).__name__} and {type(optimizer).__name__}")


def mesh_place(state: ShardedState, mesh) -> tuple[MeshShape, Place]:
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


def part_layout(state: ShardedState) -> dict:
    """Where every parameter sits in its bucket, under all its names (tied ones have two),
    and the buffers' shapes: what a checkpoint and a model must agree on."""
    names = param_names(state.module)
    buckets = [{"padded": b.padded,
                "params": [{"names": names[p], "offset": b.offsets[p],
                            "shape": list(b.shapes[p])} for p in b.params]}
               for b in state.buckets]
    buffers = {name: list(v.shape) for name, v in state.module.named_buffers()}
    return {"buckets": buckets, "buffers": buffers}


def param_names(module: nn.Module) -> dict[nn.Parameter, list[str]]:
    """Every parameter's names, in order (a tied parameter has two)."""
    names: dict[nn.Parameter, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(name)
    return names


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share memory: fp32 parameters are their own masters."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
