"""engine.zero: stages 0-2 equal data parallelism, hold 1/N of what the paper says, and send
what the paper says."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn

from engine import theory
from engine.observe.meter import CommMeter
from engine.dp import DataParallel
from engine.model.mlp import MLP
from engine.model.data import regression_data, shard
from engine.zero import ZeroOptimizer
from tests.helpers import BEYOND_CPU, DEVICE_WORLD_SIZES, rank_device, run_ranks

SIZES = (16, 33, 31, 8)  # 1871 parameters: no world size divides the buckets evenly
CAPS = {1: 1.0, 3: 0.001}  # buckets -> bucket_cap_mb


def _train(rank, world_size, stage, cap, steps=3, accumulate=1, device="cpu"):
    on = rank_device(device)
    x, y = (t.to(on) for t in regression_data(8 * world_size * accumulate, 16, 8, seed=1))
    xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
    ref = DataParallel(MLP(SIZES, seed=2).to(on))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    model = MLP(SIZES, seed=2 + rank).to(on)  # differs until the optimizer broadcasts it
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, bucket_cap_mb=cap,
                        lr=1e-2, weight_decay=0.1)
    for _ in range(steps):
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            for xb, yb in zip(xs.chunk(accumulate), ys.chunk(accumulate), strict=True):
                (nn.functional.mse_loss(m(xb), yb) / accumulate).backward()
            o.step()
    worst = max((a - b).abs().max().item()
                for a, b in zip(ref.parameters(), model.parameters(), strict=True))
    return worst, len(opt.buckets)


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("buckets", [1, 3])
def test_every_stage_equals_data_parallel_adamw(stage, world_size, buckets):
    for worst, count in run_ranks(_train, world_size, stage, CAPS[buckets]):
        assert count == buckets
        assert worst <= 1e-6


@pytest.mark.parametrize("device", BEYOND_CPU)
@pytest.mark.parametrize("world_size", DEVICE_WORLD_SIZES)
@pytest.mark.parametrize("stage", [1, 2])
def test_stages_one_and_two_equal_data_parallel_on_each_device(device, world_size, stage):
    for worst, count in run_ranks(_train, world_size, stage, CAPS[3], 3, 1, device,
                                  device=device):
        assert count == 3 and worst <= 1e-6


def test_stage_two_accumulates_micro_batches_like_data_parallel():
    for worst, _ in run_ranks(_train, 3, 2, CAPS[3], 2, 3):
        assert worst <= 1e-6


def test_world_size_one_is_plain_adamw_without_sharding():
    for stage in (1, 2):
        for worst, _ in run_ranks(_train, 1, stage, CAPS[3]):
            assert worst <= 1e-6


def _against_torch_zero(rank, world_size):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    x, y = regression_data(8 * world_size, 16, 8, seed=1)
    xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
    theirs = nn.parallel.DistributedDataParallel(MLP(SIZES, seed=2))
    their_opt = ZeroRedundancyOptimizer(theirs.parameters(), optimizer_class=torch.optim.AdamW,
                                        lr=1e-2)
    ours = MLP(SIZES, seed=2)
    our_opt = ZeroOptimizer(ours.parameters(), torch.optim.AdamW, stage=1, lr=1e-2)
    for _ in range(3):
        for m, o in ((theirs, their_opt), (ours, our_opt)):
            o.zero_grad()
            nn.functional.mse_loss(m(xs), ys).backward()
            o.step()
    return max((a - b).abs().max().item()
               for a, b in zip(theirs.parameters(), ours.parameters(), strict=True))


@pytest.mark.parametrize("world_size", [2, 3])
def test_stage_one_equals_pytorchs_zero_redundancy_optimizer(world_size):
    assert max(run_ranks(_against_torch_zero, world_size)) <= 1e-6


def test_defaults_are_pytorchs_where_zero_redundancy_optimizer_has_the_same_knob():
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ours = inspect.signature(ZeroOptimizer).parameters
    theirs = inspect.signature(ZeroRedundancyOptimizer).parameters
    assert ours["group"].default == theirs["process_group"].default
    # both take (params, optimizer class) first and hand every other keyword to that optimizer
    assert list(ours)[:2] == ["params", "optimizer_cls"]
    assert list(theirs)[:2] == ["params", "optimizer_class"]
    assert ours["kwargs"].kind == theirs["defaults"].kind == inspect.Parameter.VAR_KEYWORD


# -- memory and communication against theory --------------------------------------------------

BIG = (64, 128, 128, 8)  # 25 K parameters: per-tensor step counters are below 0.1%


def _measure(rank, world_size, stage, dtype):
    model = MLP(BIG, seed=0).to(dtype)
    psi = sum(p.numel() for p in model.parameters())
    opt = ZeroOptimizer(model.parameters(), torch.optim.Adam, stage=stage, bucket_cap_mb=0.05,
                        lr=1e-3)
    x, y = regression_data(16, 64, 8, seed=rank)
    with CommMeter() as meter:
        nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
        opt.step()
    return psi, opt.state_bytes(), meter.bytes_sent, [p.dtype for p in opt.masters]


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bytes_per_rank_match_the_zero_formula(stage, world_size, dtype):
    fp32 = dtype == torch.float32
    formula = dict(param_bytes=4, grad_bytes=4, k=8) if fp32 else {}  # else 2 + 2 + 12
    for psi, held, _, masters in run_ranks(_measure, world_size, stage, dtype):
        expected = theory.zero_model_state_bytes(psi, world_size, stage, **formula)
        for field in ("params", "grads", "optimizer"):
            assert getattr(held, field) == pytest.approx(expected[field], rel=0.02), field
        assert held.total == pytest.approx(expected["total"], rel=0.02)
        assert set(masters) == {torch.float32}


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("world_size", [2, 4])
def test_each_step_sends_two_psi_elements_as_the_paper_says(stage, world_size):
    for psi, _, sent, _ in run_ranks(_measure, world_size, stage, torch.float32):
        expected = 4 * theory.zero_comm_elements(psi, world_size, stage)
        assert sent == pytest.approx(expected, rel=0.05)


def _mixed(rank, world_size, stage):
    model = MLP(SIZES, seed=2).to(torch.bfloat16)
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=1e-2,
                        bucket_cap_mb=CAPS[3])
    x, y = regression_data(16, 16, 8, seed=rank)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(model(x.bfloat16()), y.bfloat16()).backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return flat, {p.dtype for p in model.parameters()}


def test_mixed_precision_stages_agree_and_keep_bf16_parameters():
    # two ranks: every sum has two addends, so all stages round alike and must agree exactly
    runs = {stage: run_ranks(_mixed, 2, stage) for stage in (0, 1, 2)}
    for stage in (1, 2):
        for (ours, dtypes), (base, _) in zip(runs[stage], runs[0], strict=True):
            assert dtypes == {torch.bfloat16}
            assert torch.equal(ours, base)


# -- bad input ------------------------------------------------------------------------------

def _build(rank, world_size, make):
    return make()


@pytest.mark.parametrize("make, message", [
    (lambda: ZeroOptimizer(MLP(SIZES).parameters(), torch.optim.Adam, stage=4),
     "ZeRO stage must be 0, 1, 2 or 3, got 4"),
    (lambda: ZeroOptimizer(MLP(SIZES).parameters(), torch.optim.Adam, stage="1"),
     "got '1'"),
    (lambda: ZeroOptimizer(MLP(SIZES).parameters(), torch.optim.Adam, stage=3),
     "use ZeroDataParallel"),
    (lambda: ZeroOptimizer([nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(0, 4))],
                           torch.optim.Adam), r"parameter 1 has shape \(0, 4\) and no elements"),
    (lambda: ZeroOptimizer([{"params": MLP(SIZES).parameters()}], torch.optim.Adam),
     "got param groups"),
    (lambda: ZeroOptimizer(MLP(SIZES).parameters(), torch.optim.Adam, bucket_cap_mb=0),
     "bucket_cap_mb must be a positive number, got 0"),
    (lambda: ZeroOptimizer(MLP(SIZES).parameters(), torch.optim.Adam, bucket_cap_mb=True),
     "bucket_cap_mb must be a positive number, got True"),
])
def test_bad_input_is_a_clear_error(make, message):
    with pytest.raises(Exception, match=message):
        run_ranks(_build, 1, make)


def test_unused_parameters_get_zero_gradient_in_stage_two():
    def run(rank, world_size):
        model = nn.ModuleDict({"used": nn.Linear(4, 4), "unused": nn.Linear(4, 4)})
        opt = ZeroOptimizer(model.parameters(), torch.optim.SGD, stage=2, lr=0.1,
                            bucket_cap_mb=1e-5)
        before = model["unused"].weight.detach().clone()
        model["used"](torch.ones(2, 4)).sum().backward()
        opt.step()
        return torch.equal(model["unused"].weight, before), dist.get_world_size()

    for unchanged, _ in run_ranks(run, 2):
        assert unchanged


def _offloaded(rank, world_size, offload, dtype):
    model = MLP(BIG, seed=0).to(dtype)
    opt = ZeroOptimizer(model.parameters(), torch.optim.Adam, stage=2, lr=1e-2, offload=offload)
    x, y = regression_data(16, 64, 8, seed=rank)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return flat, opt.state_bytes(), opt.offloaded_bytes(), sum(p.numel() for p in
                                                               model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_offload_moves_the_optimizer_state_off_the_device_and_changes_nothing_else(dtype):
    plain = run_ranks(_offloaded, 2, False, dtype)
    for (flat, held, offloaded, psi), (ref, ref_held, _, _) in zip(
            run_ranks(_offloaded, 2, True, dtype), plain, strict=True):
        assert torch.equal(flat, ref)
        assert held.optimizer == 0 and held.params == ref_held.params
        # off the device: fp32 master weights + Adam's two moments, 12 bytes per owned element
        assert offloaded == pytest.approx(12 * psi / 2, rel=0.02)


def _bare_save(rank, world_size, directory):
    from engine.checkpoint.per_rank import save_per_rank

    model = MLP((4, 8, 2), seed=0)
    optimizer = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-2)
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    save_per_rank(directory, model, optimizer)


def test_a_bare_zero_optimizer_is_not_saved_as_if_its_state_were_in_torchs_state_dict(tmp_path):
    """torch's default state_dict holds none of the shard's optimizer state or the fp32
    masters: a save through it would load back nothing. It is refused, naming the way."""
    from engine import RankError

    with pytest.raises(RankError, match=r"ZeroOptimizer.state_dict\(\): its state is the "
                                        r"inner optimizer's .*rank_state"):
        run_ranks(_bare_save, 2, str(tmp_path))
