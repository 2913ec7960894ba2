"""DiLoCo and streaming DiLoCo (engine.ft.diloco): data parallelism at H = 1, the algorithm
written out in one process, and the bytes of its syncs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import theory
from engine.observe.meter import CommMeter
from engine.ft.diloco import DiLoCo, split_fragments
from engine.dp import DataParallel
from engine.model.mlp import MLP
from engine.model.data import regression_data, shard
from tests.helpers import run_ranks

SIZES = (8, 8, 8, 8, 8)  # four Linear layers of 72 parameters: 288 in all
NUMEL = 288


def _batch(step, rank, world_size):
    x, y = regression_data(4 * world_size, 8, 8, seed=100 + step)
    return shard(x, rank, world_size), shard(y, rank, world_size)


def _inner_step(model, opt, x, y):
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _diloco_against_ddp(rank, world_size, steps):
    ddp = DataParallel(MLP(SIZES, seed=3))
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    model = MLP(SIZES, seed=3 + rank)  # DiLoCo broadcasts the first replica's parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = DiLoCo(model, opt, sync_every=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    for step in range(steps):
        x, y = _batch(step, rank, world_size)
        _inner_step(ddp, ddp_opt, x, y)
        _inner_step(model, opt, x, y)
        diloco.step()
    return (_flat(ddp.module) - _flat(model)).abs().max().item()


def test_h1_outer_sgd_lr1_is_data_parallelism():
    """H = 1, inner SGD, outer SGD at lr 1 without momentum: DDP's step, within 1e-6 (not bit
    for bit: θ - (θ - lr·g) rounds)."""
    worst = run_ranks(_diloco_against_ddp, 2, 8)
    assert max(worst) < 1e-6, worst


def _reference(world_size, steps, sync_every, lr, momentum, fragments, delay, mix):
    """Streaming DiLoCo written out in one process: every replica's model, the outer Nesterov
    step by hand, fragments as contiguous slices of the flat parameters."""
    models = [MLP(SIZES, seed=3) for _ in range(world_size)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    size = NUMEL // fragments
    start = _flat(models[0]).clone()
    momentum_buf = torch.zeros_like(start)
    inflight = {}
    stagger = sync_every // fragments
    for step in range(1, steps + 1):
        for r, (m, o) in enumerate(zip(models, opts)):
            _inner_step(m, o, *_batch(step - 1, r, world_size))
        for p in range(fragments):
            s = slice(p * size, (p + 1) * size)
            if step % sync_every == (p + 1) * stagger % sync_every:
                deltas = [start[s] - _flat(m)[s] for m in models]
                inflight[p] = (step, sum(deltas[1:], deltas[0].clone()) / world_size)
            if p in inflight and inflight[p][0] + delay == step:
                delta = inflight.pop(p)[1]
                momentum_buf[s] = momentum * momentum_buf[s] + delta
                start[s] = start[s] - lr * (delta + momentum * momentum_buf[s])
                for m in models:
                    flat = _flat(m)
                    flat[s] = mix * flat[s] + (1 - mix) * start[s] if mix else start[s]
                    torch.nn.utils.vector_to_parameters(flat, m.parameters())
    return [_flat(m) for m in models]


def _diloco_run(rank, world_size, steps, sync_every, lr, momentum, fragments, delay, mix):
    model = MLP(SIZES, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = DiLoCo(model, opt, sync_every, outer_lr=lr, outer_momentum=momentum,
                    fragments=fragments, delay=delay, mix=mix)
    for step in range(steps):
        _inner_step(model, opt, *_batch(step, rank, world_size))
        diloco.step()
    return _flat(model)


CASES = {  # steps, H, outer lr, outer momentum, fragments, delay τ, mix α
    "diloco": (9, 3, 0.7, 0.9, 1, 0, 0.0),
    "streaming": (12, 4, 0.7, 0.9, 2, 1, 0.5),
}


@pytest.mark.parametrize("case", CASES)
def test_two_replicas_equal_the_algorithm_in_one_process(case):
    got = run_ranks(_diloco_run, 2, *CASES[case])
    want = _reference(2, *CASES[case])
    worst = max((g - w).abs().max().item() for g, w in zip(got, want))
    assert worst < 1e-6, worst


def _count_bytes(rank, world_size, steps, sync_every, fragments, dtype):
    model = MLP(SIZES, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = DiLoCo(model, opt, sync_every, fragments=fragments, outer_dtype=dtype)
    per_step = []
    for step in range(steps):
        _inner_step(model, opt, *_batch(step, rank, world_size))
        with CommMeter() as meter:
            diloco.step()
        per_step.append(meter.bytes_sent)
    return per_step


@pytest.mark.parametrize("fragments,dtype", [(1, None), (4, None), (2, torch.bfloat16)])
def test_bytes_counted_equal_the_formula(fragments, dtype):
    steps, h, n = 16, 4, 2
    counted = run_ranks(_count_bytes, n, steps, h, fragments, dtype)
    b = 2 if dtype is torch.bfloat16 else 4
    for per_step in counted:
        assert sum(per_step) == theory.diloco_bytes(NUMEL, steps, h, n, b, fragments)
        assert max(per_step) == theory.diloco_peak_sync_bytes(NUMEL, n, b, fragments)
        assert max(per_step) == theory.diloco_peak_sync_bytes(NUMEL, n, b) / fragments


def test_bad_input_is_named():
    model = MLP(SIZES)
    with pytest.raises(ValueError, match="sync_every"):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=0)
    with pytest.raises(ValueError, match="fragments = 3 must divide the model's 4 layers"):
        split_fragments(model, 3)
    with pytest.raises(ValueError, match="delay = 2"):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=4, fragments=2,
               delay=2)


def test_a_tied_weight_is_in_one_fragment_only():
    from engine.model.gpt import GPTConfig, TinyGPT

    model = TinyGPT(GPTConfig(layers=2))
    fragments = split_fragments(model, 1)
    ids = [id(p) for f in fragments for p in f]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
