"""HSDP, hybrid sharded data parallelism: ZeRO-3 (or ZeRO-2) inside a group, replicas across
groups.

Zhao et al., "PyTorch FSDP: experiences on scaling fully sharded data parallel" (VLDB 2023),
section 3.2.2 (``HYBRID_SHARD``); torchft runs one such group per replica group. The world of
``R x S`` ranks is cut into ``R`` *shard groups* of ``S`` consecutive ranks (a node, or a site:
the fast links). Inside a shard group the model is ZeRO-3 (:class:`engine.zero.ZeroDataParallel`
over ``shard_group``): every rank holds ``1/S`` of the parameters, gathers them unit by unit
and reduce-scatters the gradients. The ranks holding the same shard in the ``R`` groups form a
*replica group*; at the step each rank all-reduces its reduce-scattered gradient shard there
(the slow links) and divides by ``R``, so every replica takes the step of ZeRO-3 over all
``R·S`` ranks.

The groups are views of the one mesh: :meth:`engine.topology.Mesh.split` cuts its ``dp``
dimension into ``dp_replicate x dp_shard`` (torchtitan's names, ``init_device_mesh``'s rank
sets), ``Mesh(dp=world)`` unless a mesh is given.

With ``stage=2`` the shard group runs ZeRO-2 instead (:class:`engine.zero.ZeroOptimizer`):
in this engine's variant the parameters stay whole on every rank, between steps too (no
gather in forward or backward), the gradients are reduce-scattered over the shard group
during backward, each rank all-reduces its gradient shard over the replica group, steps its
shard of the optimizer state and all-gathers the updated parameters inside the shard group
right after the step. PyTorch FSDP's ``ShardingStrategy._HYBRID_SHARD_ZERO2`` (the
``SHARD_GRAD_OP`` family) sends the same bytes at another time and holds other memory: it
all-gathers the parameters before forward, keeps them through backward and frees them after
it, so between steps a rank holds only its shard, and the gather moves to the next forward.
The replica dimension sees the same bytes as with ZeRO-3; what differs is memory (whole
parameters) against the shard group's traffic (no per-unit gathers in forward and
backward).

Bytes across the replica dimension per rank and step: ``2(R-1)/R · ψ/S`` elements
(:func:`engine.theory.hsdp_replica_bytes`), the ``S``-th of data parallelism's all-reduce
across the same links (the paper's section 3.2.2 gives ``2M(W-1)/(GW)`` per GPU for ``M``
bytes on ``W`` GPUs in hosts of ``G``; the ring over the ``R = W/G`` replicas sends
``2M(W-G)/(GW)``, a little less).

Both equal ZeRO-3 (and DDP) over all ``R·S`` ranks up to the order of the sums: a gradient
element is summed over the ``S`` ranks of its shard group, divided by ``S``, then summed over
the ``R`` replicas and divided by ``R``, where one all-reduce over every rank sums all ``R·S``
at once and divides by ``R·S``; float addition is not associative, so the two differ by a few
units in the last place (the tests bound it by 1e-6).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine.comm import ops
from engine.topology import Mesh, split_rank_sets
from engine.validation import divides, positive_int
from engine.zero.optimizer import ZeroOptimizer
from engine.zero.stage3 import ZeroDataParallel


def hsdp_rank_sets(world: int, shard_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(shard groups, replica groups) as lists of global ranks: ``S`` consecutive ranks per
    shard group; the ranks with the same index in each shard group per replica group. Pure."""
    positive_int("shard_size", shard_size)
    divides("shard_size (ranks per shard group)", shard_size, "the world size", world)
    return split_rank_sets([list(range(world))], shard_size)  # Mesh(dp=world).split("dp", S)


class HybridShardedDataParallel(nn.Module):
    """``model = HybridShardedDataParallel(module, torch.optim.AdamW, shard_size=2, lr=1e-3)``;
    then ``model(x)...backward(); model.optimizer.step(); model.optimizer.zero_grad()``.

    Args:
        module: the model; the first rank's parameters are copied to every rank (of the
            mesh's dp dimension).
        optimizer_cls, **kwargs: the optimizer, run on this rank's shards.
        shard_size: S, the ranks of one shard group (must divide the world size, or the
            mesh's dp).
        units: as for :class:`engine.zero.ZeroDataParallel` (ZeRO-3 only).
        stage: 3 (the default) or 2: ZeRO's stage inside the shard group.
        mesh: the :class:`engine.topology.Mesh` whose ``dp`` dimension HSDP splits into
            ``dp_replicate x dp_shard`` (:meth:`~engine.topology.Mesh.split`); by default
            ``Mesh(dp=world)``, which gives :func:`hsdp_rank_sets`.

    ``.shard_group``, ``.replica_group``, ``.replicas`` (R), ``.stage`` and ``.zero`` (the
    ZeRO-3 wrapper over the shard group; at stage 2 the ZeRO-2 optimizer) are public.
    """

    def __init__(self, module: nn.Module, optimizer_cls, shard_size: int, units=None,
                 stage: int = 3, mesh: Mesh | None = None, **kwargs):
        super().__init__()
        if stage not in (2, 3):
            raise ValueError(f"HSDP runs ZeRO-2 or ZeRO-3 inside a shard group; stage must be "
                             f"2 or 3, got {stage!r}")
        if stage == 2 and units is not None:
            raise ValueError("units are ZeRO-3's gather units; at stage 2 the parameters stay "
                             "whole: leave units=None")
        if mesh is None:
            hsdp_rank_sets(dist.get_world_size(), shard_size)  # the error names the world size
            mesh = Mesh(dp=dist.get_world_size())
        self.shard_size, self.replicas, self.stage = shard_size, mesh.dp // shard_size, stage
        self.shard_group, self.replica_group = mesh.split("dp", inner=shard_size)
        root = ops.group_ranks(self.replica_group)[0]
        with torch.no_grad():  # group 0's parameters everywhere (ZeRO-3 then copies its root's)
            for p in module.parameters():
                ops.broadcast(p.data, root, self.replica_group)
        if stage == 3:
            self.zero = ZeroDataParallel(module, optimizer_cls, units, group=self.shard_group,
                                         **kwargs)
        else:  # the gradients reduce-scattered in backward by the optimizer's hooks
            self.whole = module
            self.zero = ZeroOptimizer(module.parameters(), optimizer_cls, stage=2,
                                      group=self.shard_group, **kwargs)
        self.optimizer = ReplicatedShardOptimizer(self)

    def forward(self, *args, **kwargs):
        return self.zero(*args, **kwargs) if self.stage == 3 else self.whole(*args, **kwargs)

    @property
    def module(self) -> nn.Module:
        return self.zero.module if self.stage == 3 else self.whole

    def gradient_shards(self) -> list[torch.Tensor]:
        """This rank's reduce-scattered gradient shards (per ZeRO-3 unit, or ZeRO-2 bucket):
        what crosses the replica dimension."""
        if self.stage == 3:
            return [unit.shard_grad for unit in self.zero.all_units]
        return self.zero.grad_sharding.shard_grads()

    def gather_all(self) -> None:
        """Make every unit whole (to read or compare the parameters); freed by the next use.
        At stage 2 they always are."""
        if self.stage == 2:
            return
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
        for shard_grad in self.model.gradient_shards():
            ops.all_reduce(shard_grad, group=self.model.replica_group)
            shard_grad.div_(self.model.replicas)
        self.inner.step()

    @property
    def inner(self):
        """The shard group's ZeRO optimizer (stage 3's, or the ZeRO-2 optimizer itself)."""
        return self.model.zero.optimizer if self.model.stage == 3 else self.model.zero

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    @property
    def param_groups(self):
        return self.inner.param_groups
