"""What chapter 04 says about ZeRO's traffic beyond one micro-batch, counted on the wire.

* PyTorch's ``ZeroRedundancyOptimizer`` behind data parallelism all-reduces the full gradients
  and then broadcasts each rank's updated part: ``3(N-1)/N psi`` per rank on average, against
  ZeRO-1's ``2(N-1)/N psi`` (reduce-scatter + all-gather).
* With gradient accumulation over ``k`` micro-batches, stage 3 gathers and reduce-scatters again
  for every micro-batch (``k`` times the one-micro-batch traffic), stage 2 reduce-scatters every
  micro-batch but all-gathers once, stages 0 and 1 communicate once per step whatever ``k``.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

from engine import theory
from engine.observe.meter import CommMeter
from engine.comm import ops
from engine.dp import DataParallel
from engine.model.mlp import MLP
from engine.model.data import regression_data
from engine.zero import ZeroDataParallel, ZeroOptimizer
from tests.helpers import run_ranks

SIZES = (32, 64, 64, 8)
PSI = sum(p.numel() for p in MLP(SIZES).parameters())


def _pytorch_zero_step(rank, world_size):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = DataParallel(MLP(SIZES, seed=0))
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    x, y = regression_data(8, SIZES[0], SIZES[-1], seed=rank)
    # its broadcasts call torch.distributed directly: route them through the engine's ops
    with CommMeter(count="wire") as meter, mock.patch.object(dist, "broadcast", ops.broadcast):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert meter.all_counted
    return {op: row["bytes_sent"] for op, row in meter.by_op().items()}


@pytest.mark.parametrize("world_size", [2, 4])
def test_pytorchs_zero_redundancy_optimizer_sends_half_as_much_again_as_zero_1(world_size):
    rows = run_ranks(_pytorch_zero_step, world_size)
    n = world_size
    assert {op for r in rows for op in r} == {"all_reduce", "broadcast"}
    mean_elements = {op: sum(r[op] for r in rows) / n / 4 for op in ("all_reduce", "broadcast")}
    # every chunk of a ring crosses N-1 links in each phase, and every part is broadcast down a
    # chain of N-1 links: averaged over the ranks, exactly the formulas
    assert mean_elements["all_reduce"] == pytest.approx(
        theory.ring_all_reduce_bytes(PSI, n), rel=1e-12)
    assert mean_elements["broadcast"] == pytest.approx((n - 1) / n * PSI, rel=1e-12)
    zero_1 = theory.zero_comm_elements(PSI, n, 1)
    assert sum(mean_elements.values()) == pytest.approx(1.5 * zero_1, rel=1e-12)


def _accumulated(rank, world_size, stage, k):
    if stage == 3:
        model = ZeroDataParallel(MLP(SIZES, seed=0), torch.optim.Adam, lr=1e-3)
        opt = model.optimizer
    else:
        model = MLP(SIZES, seed=0)
        opt = ZeroOptimizer(model.parameters(), torch.optim.Adam, stage=stage, lr=1e-3)
    x, y = regression_data(4 * k, SIZES[0], SIZES[-1], seed=rank)
    with CommMeter(count="wire") as meter:
        for xk, yk in zip(x.chunk(k), y.chunk(k), strict=True):
            (nn.functional.mse_loss(model(xk), yk) / k).backward()
        opt.step()
    return {op: row["bytes_sent"] for op, row in meter.by_op().items()}


# per collective: how many times the one-micro-batch traffic k micro-batches send
GROWTH = {
    0: {"all_reduce": lambda k: 1},
    1: {"reduce_scatter": lambda k: 1, "all_gather": lambda k: 1},
    2: {"reduce_scatter": lambda k: k, "all_gather": lambda k: 1},
    3: {"reduce_scatter": lambda k: k, "all_gather": lambda k: k},
}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradient_accumulation_multiplies_what_each_stage_sends_per_micro_batch(stage):
    one = run_ranks(_accumulated, 2, stage, 1)[0]
    assert set(one) == set(GROWTH[stage])
    for k in (2, 3):
        many = run_ranks(_accumulated, 2, stage, k)[0]
        assert many == {op: GROWTH[stage][op](k) * sent for op, sent in one.items()}, k
