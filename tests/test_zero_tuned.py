"""``TunedZeroOptimizer``: ``ZeroOptimizer`` with its step's collectives on the engine's tuned
ring. It trains like data parallelism, sends what the paper says, really runs the ring on
Gloo (and the built-ins elsewhere), and works inside a process subgroup."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from engine import theory
from engine.observe.meter import CommMeter
from engine.dp import DataParallel
from engine.model.mlp import MLP
from engine.model.data import regression_data, shard
from engine.zero import TunedZeroOptimizer, ZeroOptimizer
from tests.helpers import BEYOND_CPU, DEVICE_WORLD_SIZES, rank_device, run_ranks

SIZES = (16, 33, 31, 8)  # 1871 parameters: no world size divides the buckets evenly
CAPS = {1: 1.0, 3: 0.001}  # buckets -> bucket_cap_mb


def _train(rank, world_size, stage, cap, group_of=None, steps=3, device="cpu"):
    """``group_of``: {rank: the ranks of its data-parallel group}; None: the world."""
    on = rank_device(device)
    group = None
    if group_of is not None:  # every rank creates every group, in the same order
        for ranks in sorted({tuple(r) for r in group_of.values()}):
            made = dist.new_group(list(ranks))
            if rank in ranks:
                group = made
    me, n = dist.get_rank(group), dist.get_world_size(group)
    x, y = (t.to(on) for t in regression_data(8 * n, 16, 8, seed=1))
    xs, ys = shard(x, me, n), shard(y, me, n)
    ref = DataParallel(MLP(SIZES, seed=2).to(on), group=group)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    # the group's root broadcasts its model: seed 2, as the others'
    plain, tuned = MLP(SIZES, seed=2).to(on), MLP(SIZES, seed=2 + me).to(on)
    plain_opt = ZeroOptimizer(plain.parameters(), torch.optim.AdamW, stage=stage, group=group,
                              bucket_cap_mb=cap, lr=1e-2, weight_decay=0.1)
    tuned_opt = TunedZeroOptimizer(tuned.parameters(), torch.optim.AdamW, stage=stage,
                                   group=group, bucket_cap_mb=cap, lr=1e-2, weight_decay=0.1)
    for _ in range(steps):
        for m, o in ((ref, ref_opt), (plain, plain_opt), (tuned, tuned_opt)):
            o.zero_grad()
            nn.functional.mse_loss(m(xs), ys).backward()
            o.step()

    def worst(other):
        return max((a - b).abs().max().item()
                   for a, b in zip(other.parameters(), tuned.parameters(), strict=True))
    return worst(ref), worst(plain), len(tuned_opt.buckets)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("buckets", [1, 3])
def test_tuned_equals_data_parallel_and_the_readable_optimizer(stage, world_size, buckets):
    for vs_ddp, vs_plain, count in run_ranks(_train, world_size, stage, CAPS[buckets]):
        assert count == buckets
        assert vs_ddp <= 1e-6 and vs_plain <= 1e-6


@pytest.mark.parametrize("device", BEYOND_CPU)
@pytest.mark.parametrize("world_size", DEVICE_WORLD_SIZES)
def test_tuned_equals_data_parallel_on_each_device(device, world_size):
    # on CUDA tensors the built-in collectives run (host-staged on Gloo), as in ZeroOptimizer
    for vs_ddp, vs_plain, _ in run_ranks(_train, world_size, 1, CAPS[3], None, 3, device,
                                         device=device):
        assert vs_ddp <= 1e-6 and vs_plain <= 1e-6


def test_tuned_trains_inside_data_parallel_subgroups():
    # two groups of two, interleaved as a dp x tp mesh lays them out: {0, 2} and {1, 3}
    group_of = {0: (0, 2), 2: (0, 2), 1: (1, 3), 3: (1, 3)}
    for vs_ddp, vs_plain, _ in run_ranks(_train, 4, 1, CAPS[3], group_of):
        assert vs_ddp <= 1e-6 and vs_plain <= 1e-6


BIG = (64, 128, 128, 8)


def _one_step(rank, world_size, optimizer, count):
    model = MLP(BIG, seed=0)
    opt = optimizer(model.parameters(), torch.optim.Adam, stage=1, bucket_cap_mb=0.05, lr=1e-3)
    x, y = regression_data(16, 64, 8, seed=rank)
    nn.functional.mse_loss(model(x), y).backward()
    with CommMeter(count=count) as meter:
        opt.step()
    padded = sum(b.padded for b in opt.buckets)
    return padded, meter.bytes_sent, {(e.op, e.measured) for e in meter.events}


@pytest.mark.parametrize("world_size", [2, 4])
def test_tuned_stage_one_sends_a_reduce_scatter_and_an_all_gather_on_the_ring(world_size):
    for padded, sent, seen in run_ranks(_one_step, world_size, TunedZeroOptimizer, "model"):
        # padded buckets: N divides each, so the formula is exact
        assert sent == 2 * theory.ring_reduce_scatter_bytes(4 * padded, world_size)
        # even in "model" mode every event is a counted point-to-point message: the ring ran
        assert seen == {("isend", True), ("irecv", True)}
    for padded, sent, seen in run_ranks(_one_step, world_size, ZeroOptimizer, "model"):
        assert sent == 2 * theory.ring_reduce_scatter_bytes(4 * padded, world_size)
        assert {op for op, _ in seen} == {"reduce_scatter", "all_gather"}  # the built-ins


def _build(rank, world_size, kwargs):
    return TunedZeroOptimizer(MLP(SIZES).parameters(), torch.optim.Adam, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(stage=3), "use ZeroDataParallel"),
    (dict(stage=4), "ZeRO stage must be 0, 1, 2 or 3, got 4"),
    (dict(bucket_cap_mb=True), "bucket_cap_mb must be a positive number, got True"),
])
def test_bad_input_is_refused_as_by_zero_optimizer(kwargs, message):
    with pytest.raises(Exception, match=message):
        run_ranks(_build, 1, kwargs)

