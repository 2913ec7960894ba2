"""ZeRO stage 3 (engine.zero.ZeroDataParallel): equal to data parallelism and to FSDP, holding
16 psi / N bytes, gathering one unit at a time, sending 3 psi elements per step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import theory
from engine.observe.meter import CommMeter
from engine.dp import DataParallel
from engine.model.mlp import MLP
from engine.model.gpt import GPTConfig, TinyGPT
from engine.model.data import regression_data, shard, token_data
from engine.zero import ZeroDataParallel, ZeroOptimizer
from tests.helpers import BEYOND_CPU, DEVICE_WORLD_SIZES, rank_device, run_ranks

SIZES = (16, 33, 31, 8)


def _step(model, optimizer, x, y):
    optimizer.zero_grad()
    with CommMeter() as meter:
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return meter


# (forward_prefetch, backward_prefetch)
NO_PREFETCH, FSDP_DEFAULTS, BOTH = (False, False), (False, True), (True, True)
PREFETCHES = [NO_PREFETCH, (True, False), FSDP_DEFAULTS, BOTH]


def _prefetch(flags):
    return dict(zip(("forward_prefetch", "backward_prefetch"), flags, strict=True))


def _against_data_parallel(rank, world_size, prefetch, steps=3, device="cpu"):
    on = rank_device(device)
    x, y = (t.to(on) for t in regression_data(8 * world_size, 16, 8, seed=1))
    xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
    ref = DataParallel(MLP(SIZES, seed=2).to(on))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model = ZeroDataParallel(MLP(SIZES, seed=2 + rank).to(on), torch.optim.AdamW,
                             **_prefetch(prefetch), lr=1e-2)
    for _ in range(steps):
        _step(ref, ref_opt, xs, ys)
        meter = _step(model, model.optimizer, xs, ys)
    held = model.state_bytes()  # between steps: shards only
    peak = model.peak_gathered_bytes
    for unit in model.all_units:  # gather everything to compare
        unit.start_gather(None)
        unit.finish_gather()
    worst = max((a - b).abs().max().item()
                for a, b in zip(ref.parameters(), model.module.parameters(), strict=True))
    psi = sum(p.numel() for p in ref.parameters())
    units = sorted((u.full_bytes for u in model.units), reverse=True)
    return worst, psi, held, peak, units, meter.bytes_sent


@pytest.mark.parametrize("prefetch", PREFETCHES)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_stage_three_equals_data_parallel_adamw(world_size, prefetch):
    for worst, *_ in run_ranks(_against_data_parallel, world_size, prefetch):
        assert worst <= 1e-6


@pytest.mark.parametrize("device", BEYOND_CPU)
@pytest.mark.parametrize("world_size", DEVICE_WORLD_SIZES)
def test_stage_three_equals_data_parallel_on_each_device(device, world_size):
    for worst, *_ in run_ranks(_against_data_parallel, world_size, BOTH, 3, device,
                               device=device):
        assert worst <= 1e-6


@pytest.mark.parametrize("world_size", [2, 4])
def test_stage_three_holds_sixteen_psi_over_n_and_sends_three_psi(world_size):
    for _, psi, held, _, _, sent in run_ranks(_against_data_parallel, world_size, NO_PREFETCH):
        expected = theory.zero_model_state_bytes(psi, world_size, 3, k=8, param_bytes=4,
                                                 grad_bytes=4)
        for field in ("params", "grads", "optimizer", "total"):
            assert getattr(held, field) == pytest.approx(expected[field], rel=0.02), field
        assert sent == pytest.approx(4 * theory.zero_comm_elements(psi, world_size, 3),
                                     rel=0.05)


@pytest.mark.parametrize("prefetch, units_held",
                         [(NO_PREFETCH, 1), ((True, False), 2), (FSDP_DEFAULTS, 2), (BOTH, 2)])
def test_only_one_unit_is_gathered_at_a_time_two_with_prefetch(prefetch, units_held):
    for _, _, _, peak, units, _ in run_ranks(_against_data_parallel, 2, prefetch):
        assert peak <= sum(units[:units_held])
        assert peak > sum(units[:units_held - 1])  # and it does hold that many


def _gpt(rank, world_size, prefetch):
    config = GPTConfig(vocab=32, seq_len=8, layers=2, heads=2, hidden=16)
    x, y = token_data(4 * world_size, 8, 32, seed=3)
    xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)

    def loss_of(model):
        logits = model(xs)
        return nn.functional.cross_entropy(logits.flatten(0, 1), ys.flatten())

    ref = DataParallel(TinyGPT(config, seed=0))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    inner = TinyGPT(config, seed=0)
    model = ZeroDataParallel(inner, torch.optim.AdamW, units=inner.blocks,
                             **_prefetch(prefetch), lr=1e-2)
    for _ in range(2):
        for m, opt in ((ref, ref_opt), (model, model.optimizer)):
            opt.zero_grad()
            loss_of(m).backward()
            opt.step()
    for unit in model.all_units:
        unit.start_gather(None)
        unit.finish_gather()
    tied = inner.head.weight is inner.tok.weight
    return max((a - b).abs().max().item() for a, b in
               zip(ref.parameters(), model.module.parameters(), strict=True)), tied, \
        [u.name for u in model.all_units]


@pytest.mark.parametrize("prefetch", PREFETCHES)
def test_tiny_gpt_with_blocks_as_units_and_tied_embeddings_in_the_root(prefetch):
    for worst, tied, names in run_ranks(_gpt, 2, prefetch):
        assert tied and names == ["(root)", "Block", "Block"]
        assert worst <= 1e-6


def _against_fsdp(rank, world_size, strategy):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    x, y = regression_data(8 * world_size, 16, 8, seed=1)
    xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
    theirs = FSDP(MLP(SIZES, seed=2), device_id=torch.device("cpu"),
                  sharding_strategy=getattr(ShardingStrategy, strategy), use_orig_params=True)
    their_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    if strategy == "FULL_SHARD":
        ours = ZeroDataParallel(MLP(SIZES, seed=2), torch.optim.AdamW, lr=1e-2)
        our_opt = ours.optimizer
    else:
        ours = MLP(SIZES, seed=2)
        our_opt = ZeroOptimizer(ours.parameters(), torch.optim.AdamW, stage=2, lr=1e-2)
    for _ in range(3):
        _step(theirs, their_opt, xs, ys)
        _step(ours, our_opt, xs, ys)
    with FSDP.summon_full_params(theirs):
        their_params = [p.detach().clone() for p in theirs.parameters()]
    if strategy == "FULL_SHARD":
        for unit in ours.all_units:
            unit.start_gather(None)
            unit.finish_gather()
        ours = ours.module
    return max((a - b).abs().max().item()
               for a, b in zip(their_params, ours.parameters(), strict=True))


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_stages_three_and_two_equal_pytorch_fsdp(strategy):
    assert max(run_ranks(_against_fsdp, 2, strategy)) <= 1e-6


def _bf16(rank, world_size, stage):
    model = MLP(SIZES, seed=2).to(torch.bfloat16)
    if stage == 3:
        model = ZeroDataParallel(model, torch.optim.AdamW, lr=1e-2)
        opt = model.optimizer
    else:
        opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=1e-2)
    x, y = regression_data(16, 16, 8, seed=rank)
    for _ in range(3):
        _step(model, opt, x.bfloat16(), y.bfloat16())
    held = model.state_bytes() if stage == 3 else opt.state_bytes()
    if stage == 3:
        for unit in model.all_units:
            unit.start_gather(None)
            unit.finish_gather()
        model = model.module
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), held


def test_stage_three_in_bf16_keeps_fp32_masters_two_two_twelve():
    psi = sum(p.numel() for p in MLP(SIZES).parameters())
    base = run_ranks(_bf16, 2, 0)
    for (ours, held), (reference, _) in zip(run_ranks(_bf16, 2, 3), base, strict=True):
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, reference)
        expected = theory.zero_model_state_bytes(psi, 2, 3)  # 2 + 2 + 12 bytes, all over N
        for field in ("params", "grads", "optimizer"):
            assert getattr(held, field) == pytest.approx(expected[field], rel=0.02), field


def test_prefetch_defaults_are_pytorch_fsdps():
    """FSDP prefetches in backward (``BackwardPrefetch.BACKWARD_PRE``), not in forward; read
    from PyTorch itself, not typed here."""
    import inspect

    from torch.distributed.fsdp import BackwardPrefetch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    ours = inspect.signature(ZeroDataParallel).parameters
    theirs = inspect.signature(FSDP).parameters
    assert ours["forward_prefetch"].default == theirs["forward_prefetch"].default
    # BACKWARD_PRE: gather the next unit before the current unit's backward, what ours does
    assert ours["backward_prefetch"].default is (
        theirs["backward_prefetch"].default is BackwardPrefetch.BACKWARD_PRE)
    assert ours["group"].default == theirs["process_group"].default


def _refused(rank, world_size, kwargs):
    try:
        ZeroDataParallel(MLP(SIZES, seed=0), torch.optim.AdamW, lr=1e-2, **kwargs)
    except (TypeError, ValueError) as error:
        return str(error)
    return None


@pytest.mark.parametrize("kwargs, says", [
    (dict(prefetch=True), "forward_prefetch= and backward_prefetch="),
    (dict(forward_prefetch=1), "forward_prefetch must be True or False, got 1"),
    (dict(backward_prefetch="BACKWARD_PRE"), "backward_prefetch must be True or False, got 'BACKWARD_PRE'"),
])
def test_bad_prefetch_arguments_are_refused_by_name(kwargs, says):
    message, = run_ranks(_refused, 1, kwargs)
    assert message is not None and says in message
