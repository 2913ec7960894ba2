"""HSDP, hybrid sharded data parallelism: ZeRO-3 inside a group, replicas across groups.

Zhao et al., "PyTorch FSDP: experiences on scaling fully sharded data parallel" (VLDB 2023),
section 3.2.3 (``HYBRID_SHARD``); torchft runs one such group per replica group. The world of
``R x S`` ranks is cut into ``R`` *shard groups* of ``S`` consecutive ranks (a node, or a site:
the fast links). Inside a shard group the model is ZeRO-3 (:class:`engine.zero.ZeroDataParallel`
over ``shard_group``): every rank holds ``1/S`` of the parameters, gathers them unit by unit
and reduce-scatters the gradients. The ranks holding the same shard in the ``R`` groups form a
*replica group*; at the step each rank all-reduces its reduce-scattered gradient shard there
(the slow links) and divides by ``R``, so every replica takes the step of ZeRO-3 over all
``R·S`` ranks.

Bytes across the replica dimension per rank and step: ``2(R-1)/R · ψ/S`` elements
(:func:`engine.theory.hsdp_replica_bytes`), the ``S``-th of data parallelism's all-reduce
across the same links.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine.comm import ops
from engine.topology import new_groups
from engine.validation import divides, positive_int
from engine.zero.stage3 import ZeroDataParallel


def hsdp_rank_sets(world: int, shard_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(shard groups, replica groups) as lists of global ranks: ``S`` consecutive ranks per
    shard group; the ranks with the same index in each shard group per replica group. Pure."""
    positive_int("shard_size", shard_size)
    divides("shard_size (ranks per shard group)", shard_size, "the world size", world)
    replicas = world // shard_size
    shards = [list(range(g * shard_size, (g + 1) * shard_size)) for g in range(replicas)]
    return shards, [list(range(i, world, shard_size)) for i in range(shard_size)]


class HybridShardedDataParallel(nn.Module):
    """``model = HybridShardedDataParallel(module, torch.optim.AdamW, shard_size=2, lr=1e-3)``;
    then ``model(x)...backward(); model.optimizer.step(); model.optimizer.zero_grad()``.

    Args:
        module: the model; the first rank's parameters are copied to every rank.
        optimizer_cls, **kwargs: the optimizer, run on this rank's shards.
        shard_size: S, the ranks of one shard group (must divide the world size).
        units: as for :class:`engine.zero.ZeroDataParallel`.

    ``.shard_group``, ``.replica_group``, ``.replicas`` (R) and ``.zero`` (the ZeRO-3 wrapper
    over the shard group) are public.
    """

    def __init__(self, module: nn.Module, optimizer_cls, shard_size: int, units=None, **kwargs):
        super().__init__()
        world, rank = dist.get_world_size(), dist.get_rank()
        shard_sets, replica_sets = hsdp_rank_sets(world, shard_size)
        self.shard_size, self.replicas = shard_size, world // shard_size
        self.shard_group = new_groups(shard_sets, rank)
        self.replica_group = new_groups(replica_sets, rank)
        with torch.no_grad():  # group 0's parameters everywhere (ZeRO-3 then copies its root's)
            for p in module.parameters():
                ops.broadcast(p.data, replica_sets[rank % shard_size][0], self.replica_group)
        self.zero = ZeroDataParallel(module, optimizer_cls, units, group=self.shard_group,
                                     **kwargs)
        self.optimizer = ReplicatedShardOptimizer(self)

    def forward(self, *args, **kwargs):
        return self.zero(*args, **kwargs)

    @property
    def module(self) -> nn.Module:
        return self.zero.module

    def gather_all(self) -> None:
        """Make every unit whole (to read or compare the parameters); freed by the next use."""
        for unit in self.zero.all_units:
            unit.start_gather(self.shard_group)
            unit.finish_gather()


class ReplicatedShardOptimizer:
    """``model.optimizer`` of HSDP: all-reduces each gradient shard over the replica group,
    divides by R, then runs ZeRO-3's step on the shards."""

    def __init__(self, model: HybridShardedDataParallel):
        self.model = model

    @torch.no_grad()
    def step(self) -> None:
        for unit in self.model.zero.all_units:
            ops.all_reduce(unit.shard_grad, group=self.model.replica_group)
            unit.shard_grad.div_(self.model.replicas)
        self.model.zero.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero.optimizer.zero_grad(set_to_none)

    @property
    def param_groups(self):
        return self.model.zero.optimizer.param_groups
