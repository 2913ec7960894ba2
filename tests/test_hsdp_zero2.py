"""HSDP with ZeRO-2 inside the shard groups (engine.zero.hsdp, stage=2): parameters whole on
every rank, gradients reduce-scattered over the shard group, the shards all-reduced across
the replicas. Equal to ZeRO-3 and to DDP over every rank within 1e-6 (the sums run in another
order: over the shard group, then over the replicas, each divided by its size, against one sum
over all ranks divided by R·S); the bytes across the replica dimension counted =
theory.hsdp_replica_bytes, the S-th of DDP's across the same links."""

from __future__ import annotations

import pytest
import torch

from torch import nn

from engine import theory
from engine.observe.meter import CommMeter
from engine.dp import DataParallel
from engine.model.mlp import MLP
from engine.model.data import regression_data, shard
from engine.zero import ZeroDataParallel
from engine.zero.hsdp import HybridShardedDataParallel, hsdp_rank_sets
from tests.helpers import run_ranks
from tests.test_hsdp import SIZES


def _run(model, rank, world_size, steps, replica_group=None):
    """``steps`` steps on the global batch; per step, the bytes this rank sent in the
    optimizer step through ``replica_group`` (its global ranks)."""
    sent = []
    for step in range(steps):
        x, y = regression_data(4 * world_size, 8, 8, seed=10 + step)
        model.optimizer.zero_grad()
        nn.functional.mse_loss(model(shard(x, rank, world_size)),
                               shard(y, rank, world_size)).backward()
        with CommMeter() as meter:  # the step: the replica all-reduce, the group's all-gather
            model.optimizer.step()
        sent.append(sum(e.bytes_sent for e in meter.events
                        if e.group == tuple(replica_group or ())))
    return sent


class _DDP(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.wrapped = DataParallel(module)
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)

    def forward(self, x):
        return self.wrapped(x)


def _zero2_against_zero3_and_ddp(rank, world_size, shard_size, steps=4):
    plain = ZeroDataParallel(MLP(SIZES, seed=5), torch.optim.AdamW, lr=1e-2)
    ddp = _DDP(MLP(SIZES, seed=5))
    hsdp = HybridShardedDataParallel(MLP(SIZES, seed=5 + rank), torch.optim.AdamW, shard_size,
                                     stage=2, lr=1e-2)
    _run(plain, rank, world_size, steps)
    _run(ddp, rank, world_size, steps)
    replicas = hsdp_rank_sets(world_size, shard_size)[1][rank % shard_size]
    sent = _run(hsdp, rank, world_size, steps, replicas)
    for unit in plain.all_units:
        unit.start_gather(None)
        unit.finish_gather()
    ours = list(hsdp.module.parameters())
    return ([(a - b).abs().max().item() for a, b in zip(plain.module.parameters(), ours,
                                                          strict=True)],
            [(a - b).abs().max().item() for a, b in zip(ddp.wrapped.module.parameters(), ours,
                                                          strict=True)],
            sent)


@pytest.mark.parametrize("shard_size", [2, 4])
def test_hsdp_zero2_equals_zero3_and_ddp_and_counts_the_replica_bytes(shard_size):
    world = 4
    numel = sum(p.numel() for p in MLP(SIZES).parameters())
    replicas = world // shard_size
    for to_zero3, to_ddp, sent in run_ranks(_zero2_against_zero3_and_ddp, world, shard_size):
        assert max(to_zero3) < 1e-6 and max(to_ddp) < 1e-6, (to_zero3, to_ddp)
        want = theory.hsdp_replica_bytes(numel, shard_size, replicas)
        assert sent == [want] * len(sent)  # 0 at shard_size = world: nothing to replicate
        assert want == theory.ring_all_reduce_bytes(numel * 4, replicas) / shard_size


def test_a_bad_stage_is_named_before_any_group_is_made():
    with pytest.raises(ValueError, match="stage must be 2 or 3, got 1"):
        HybridShardedDataParallel(MLP(SIZES), torch.optim.AdamW, 1, stage=1)
    with pytest.raises(ValueError, match="at stage 2 the parameters stay whole"):
        HybridShardedDataParallel(MLP(SIZES), torch.optim.AdamW, 1, units=[[0]], stage=2)
