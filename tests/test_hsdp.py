"""HSDP (engine.zero.hsdp): ZeRO-3 inside shard groups, all-reduce across replica groups;
equal to ZeRO-3 over every rank, with the bytes across replicas cut by the shard factor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import theory
from engine.observe.meter import CommMeter
from engine.model.mlp import MLP
from engine.model.data import regression_data, shard
from engine.zero import ZeroDataParallel
from engine.zero.hsdp import HybridShardedDataParallel, hsdp_rank_sets
from tests.helpers import run_ranks

SIZES = (8, 8, 8, 8, 8)  # four units of 72 parameters


def _run(model, rank, world_size, steps):
    sent = []
    for step in range(steps):
        x, y = regression_data(4 * world_size, 8, 8, seed=10 + step)
        model.optimizer.zero_grad()
        nn.functional.mse_loss(model(shard(x, rank, world_size)),
                               shard(y, rank, world_size)).backward()
        with CommMeter() as meter:  # the step: HSDP's replica all-reduce only
            model.optimizer.step()
        sent.append(meter.bytes_sent)
    return sent


def _hsdp_against_zero3(rank, world_size, shard_size, steps=4):
    plain = ZeroDataParallel(MLP(SIZES, seed=5), torch.optim.AdamW, lr=1e-2)
    hsdp = HybridShardedDataParallel(MLP(SIZES, seed=5 + rank), torch.optim.AdamW, shard_size,
                                     lr=1e-2)
    _run(plain, rank, world_size, steps)
    sent = _run(hsdp, rank, world_size, steps)
    for unit in plain.all_units:
        unit.start_gather(None)
        unit.finish_gather()
    hsdp.gather_all()
    worst = max((a - b).abs().max().item() for a, b in
                zip(plain.module.parameters(), hsdp.module.parameters(), strict=True))
    return worst, sent


@pytest.mark.parametrize("shard_size", [1, 2, 4])
def test_hsdp_equals_zero3_and_counts_the_replica_bytes(shard_size):
    world = 4
    results = run_ranks(_hsdp_against_zero3, world, shard_size)
    numel = sum(p.numel() for p in MLP(SIZES).parameters())
    replicas = world // shard_size
    for worst, sent in results:
        assert worst < 1e-6, worst
        want = theory.hsdp_replica_bytes(numel, shard_size, replicas)
        assert sent == [want] * len(sent)
        ddp = theory.ring_all_reduce_bytes(numel * 4, replicas)  # DDP across the same links
        assert want == ddp / shard_size


def test_a_shard_size_that_does_not_divide_the_world_is_named():
    assert hsdp_rank_sets(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    with pytest.raises(ValueError, match="shard_size .* = 3 must divide the world size = 4"):
        hsdp_rank_sets(4, 3)
