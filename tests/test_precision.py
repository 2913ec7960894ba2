"""Chapter 12's precision parts: the loss scaler against torch.amp.GradScaler, fp16's
underflow, FP8 scaling's error ordering on an outlier channel, and the FP8 all-gather's bytes."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from engine import theory
from engine.observe.meter import CommMeter
from engine.model.data import noise_regression_data
from engine.precision import (DynamicLossScaler, Fp8Linear, bytes_per_parameter, fp8_all_gather,
                              fp8_matmul, gradient_underflow, outlier_activations,
                              plain_all_gather, quantize, relative_error,
                              scaling_errors, small_mlp, to_fp8, token_relative_error, train_lm,
                              train_mixed, underflow_experiment)
from engine.precision.fp8_comm import fp8_cast
from engine.precision.mixed import low_precision_grads
from tests.helpers import run_ranks

pytestmark = pytest.mark.filterwarnings("error")

INF_AT = {2, 3, 9, 10, 11, 17}  # steps whose gradients get an inf (or a NaN)


def _run(scaler, steps=24, clip=False):
    """SGD on a small net, the same data each step; ``INF_AT`` steps poisoned."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(16, 8)
    scales, stepped = [], []
    for step in range(steps):
        optimizer.zero_grad()
        before = copy.deepcopy(model.state_dict())
        scaler.scale((model(x) ** 2).mean()).backward()
        if step in INF_AT:
            model.weight.grad[0, 0] = math.nan if step == 10 else math.inf
        if clip:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        stepped.append(not torch.equal(before["weight"], model.weight))
    return scales, stepped, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("clip", [False, True])
def test_the_scaler_decides_as_grad_scaler_does(clip):
    kwargs = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ours = _run(DynamicLossScaler(**kwargs), clip=clip)
    torchs = _run(torch.amp.GradScaler("cpu", **kwargs), clip=clip)
    assert ours[0] == torchs[0]  # the scale after every step
    assert ours[1] == torchs[1]  # which steps were taken
    assert [s for s, took in enumerate(ours[1]) if not took] == sorted(INF_AT)
    for a, b in zip(ours[2], torchs[2]):
        assert torch.equal(a, b)  # bit for bit
    print("scales:", ours[0])


def _two_optimizers(scaler):
    """Two optimizers, the second's gradient poisoned at step 1: only its step is skipped."""
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    opt_a, opt_b = torch.optim.SGD([a], lr=0.1), torch.optim.SGD([b], lr=0.1)
    for step in range(3):
        scaler.scale((a * 2).sum() + (b * 3).sum()).backward()
        if step == 1:
            b.grad[0] = math.inf
        scaler.step(opt_a)
        scaler.step(opt_b)
        scaler.update()
        opt_a.zero_grad()
        opt_b.zero_grad()
    return a.detach().clone(), b.detach().clone(), scaler.get_scale()


def test_with_two_optimizers_only_the_poisoned_one_skips_as_with_grad_scaler():
    ours, torchs = _two_optimizers(DynamicLossScaler()), _two_optimizers(
        torch.amp.GradScaler("cpu"))
    assert all(torch.equal(x, y) for x, y in zip(ours[:2], torchs[:2])) and ours[2] == torchs[2]


def test_the_scaler_defaults_are_grad_scalers():
    ours, torchs = DynamicLossScaler(), torch.amp.GradScaler("cpu")
    assert ours.get_scale() == torchs.get_scale() == 2.0**16
    assert (ours.growth_factor, ours.backoff_factor, ours.growth_interval) == (
        torchs.get_growth_factor(), torchs.get_backoff_factor(), torchs.get_growth_interval())


def test_the_scaler_rejects_bad_input_and_misuse():
    with pytest.raises(ValueError, match="backoff_factor.*1.5"):
        DynamicLossScaler(backoff_factor=1.5)
    with pytest.raises(ValueError, match="growth_interval.*0"):
        DynamicLossScaler(growth_interval=0)
    scaler, p = DynamicLossScaler(), nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.ones(2)
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(optimizer)


def test_fp16_without_scaling_flushes_gradients_and_scaling_rescues_them():
    model, (x, y) = small_mlp(), noise_regression_data()
    plain = gradient_underflow(model, x, y, torch.float16, scale=1.0)
    scaled = gradient_underflow(model, x, y, torch.float16, scale=2.0**10)
    bf16 = gradient_underflow(model, x, y, torch.bfloat16)
    print(f"flushed to zero: fp16 {plain.flushed} of {plain.nonzero}, fp16 x 2^10 "
          f"{scaled.flushed}, bf16 {bf16.flushed}")
    assert plain.flushed > 1000 and plain.overflowed == 0
    assert scaled.flushed < plain.flushed / 100 and bf16.flushed == 0
    # what the scaler backs off from: fp16 gradients past 65504. The loss is taken in fp32, as
    # under autocast: an fp16 loss times 2^16 is inf itself, an overflow that is not the gradients'
    assert gradient_underflow(model, x, y, torch.float16, 2.0**16, fp32_loss=True).overflowed == 0
    overflowing = gradient_underflow(model, x, y, torch.float16, 2.0**28, fp32_loss=True)
    assert overflowing.overflowed > 0


def test_fp16_with_the_scaler_trains_like_bf16():
    """The loss in fp32, as autocast computes it, so that an inf can only come from the
    gradients (an fp16 loss times 2^16 is inf itself). Started at 2^28 the fp16 gradients
    overflow (measured: the output bias's, a sum over the rows): the scaler skips and backs off
    to 2^26, where they fit, and then trains like bf16."""
    init = 2.0**28
    runs = {"bf16": train_mixed("bf16", steps=8, rows=128),
            "fp16+scaler": train_mixed("fp16+scaler", steps=8, rows=128, init_scale=init,
                                       fp32_loss=True)}
    scaled = runs["fp16+scaler"]
    loss, grads = low_precision_grads(small_mlp(), *noise_regression_data(128), torch.float16,
                                      init, fp32_loss=True)
    fp16_max = torch.finfo(torch.float16).max
    # the gradients themselves overflow; the scaled loss is past fp16's range at every scale
    # used (an fp16 loss would be inf at each step), yet in fp32 it skips nothing at 2^26
    assert not all(g.isfinite().all() for g in grads) and loss * 2.0**26 > fp16_max
    assert scaled.scales[scaled.skipped:] == [2.0**26] * (8 - scaled.skipped)
    assert scaled.skipped >= 1 and scaled.scales[0] == init  # it backed off from overflow
    assert sum(scaled.flushed[scaled.skipped:]) < 10
    # one step behind for each skipped step, else the same descent (bf16's loss has 8 bits)
    behind = runs["bf16"].losses[:len(scaled.losses) - scaled.skipped]
    assert scaled.losses[scaled.skipped:] == pytest.approx(behind, rel=1e-2)
    print("bf16:", runs["bf16"].losses, "\nfp16 + scaler:", scaled.losses, scaled.scales)
    psi = sum(p.numel() for p in small_mlp().parameters())
    per_param = bytes_per_parameter(torch.bfloat16)
    held = runs["bf16"].held
    print("bytes held (bf16 working copy):", held)
    for kind in ("master (fp32)", "working copy", "working gradient", "master gradient (fp32)"):
        assert held[kind] == per_param[kind] * psi
    assert held["optimizer state"] == 8 * psi + 4 * 8  # Adam's moments; 8 step counters


def test_per_tensor_fp8_is_worse_than_per_row_and_tiles_on_an_outlier_channel():
    a = outlier_activations()  # 256 x 512, channel 7 a hundred times the rest
    b = 0.05 * torch.randn(512, 256, generator=torch.Generator().manual_seed(3))
    per_token = scaling_errors(a, b)
    overall = scaling_errors(a, b, metric=relative_error)
    print("per-token relative error:", per_token, "\nFrobenius relative error:", overall)
    for errors in (per_token, overall):
        assert errors["tensor"] > errors["row"] > errors["block"]
    assert per_token["tensor"] > 2 * per_token["block"]
    plain = scaling_errors(outlier_activations(outlier=1.0, spread=0.0), b)
    assert max(plain.values()) < 1.05 * min(plain.values())  # no outlier: all alike


def test_fp8_matmul_quantizes_what_it_says():
    a = torch.randn(4, 256)
    q, scales = quantize(a, (1, 128))
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (4, 1, 2, 1)
    assert q.float().abs().amax() == 448.0  # each tile's largest value at the format's max
    out = fp8_matmul(a, torch.randn(256, 128), "block", fmt="e5m2")
    assert out.dtype == torch.float32 and out.shape == (4, 128)
    assert token_relative_error(out, out) == 0.0


def test_fp8_bad_input_names_the_value():
    with pytest.raises(ValueError, match=r"1x128 tile does not divide the shape \(4, 200\)"):
        fp8_matmul(torch.randn(4, 200), torch.randn(200, 128), "block")
    with pytest.raises(ValueError, match="scaling='col'"):
        fp8_matmul(torch.randn(4, 8), torch.randn(8, 8), "col")
    with pytest.raises(ValueError, match="fmt='e3m4'"):
        fp8_matmul(torch.randn(4, 8), torch.randn(8, 8), fmt="e3m4")


def _gathers(rank, world_size):
    shard = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    with CommMeter() as fp8:
        ours = fp8_all_gather(shard)
    with CommMeter() as bf16:
        plain = plain_all_gather(shard)
    return fp8.events, bf16.events, relative_error(ours, plain.float())


def test_an_fp8_all_gather_sends_half_of_bf16s_bytes():
    for fp8, bf16, error in run_ranks(_gathers, 2):
        payload, scales = fp8
        assert payload.measured and bf16[0].measured  # counted on the wire
        assert payload.bytes_sent * 2 == bf16[0].bytes_sent == 2000
        assert scales.bytes_sent == 4  # one fp32 scale per rank besides
        assert error < 0.05


def _both_scales(rank, world_size):
    shard = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    weight = torch.cat([torch.randn(1000, generator=torch.Generator().manual_seed(r))
                        for r in range(world_size)])
    out = {}
    for scale in ("tensor", "shard"):
        with CommMeter() as meter:
            values = fp8_all_gather(shard, scale=scale)
        out[scale] = (meter.bytes_sent, torch.equal(values, fp8_cast(weight)),
                      relative_error(values, weight))
    return out


def test_one_scale_per_weight_is_one_devices_cast_and_per_shard_is_not():
    """torchao's per-weight scale (an amax all-reduce before the cast) keeps single-device
    semantics; the engine's per-shard variant gathers n scales and rounds otherwise."""
    n = 4
    for rank, out in enumerate(run_ranks(_both_scales, n)):
        (tensor_bytes, tensor_same, tensor_error) = out["tensor"]
        (shard_bytes, shard_same, shard_error) = out["shard"]
        assert tensor_same and not shard_same
        assert tensor_bytes == theory.fp8_all_gather_bytes(1000, n, 1, 0) + \
            theory.ring_all_reduce_rank_bytes(1, 4, n, rank)
        assert shard_bytes == theory.fp8_all_gather_bytes(1000, n)
        assert shard_error <= tensor_error < 0.05  # finer scales, never coarser
    with pytest.raises(ValueError, match="scale='row'"):
        fp8_all_gather(torch.ones(4), scale="row")  # refused before any collective


def test_an_fp8_linear_layers_gradients_are_close_to_fp32s():
    torch.manual_seed(0)
    exact = nn.Linear(32, 48)
    fp8 = to_fp8(copy.deepcopy(exact), "block", tile=16)
    assert type(fp8) is Fp8Linear
    x = torch.randn(64, 32)
    for m in (exact, fp8):
        (m(x) ** 2).sum().backward()
    assert relative_error(fp8(x), exact(x)) < 0.05
    assert relative_error(fp8.weight.grad, exact.weight.grad) < 0.1


def test_the_tiny_gpt_trains_in_fp8_as_in_bf16():
    losses = {p: train_lm(p, steps=4) for p in ("fp32", "bf16", "fp8-block")}
    print({p: [round(v, 4) for v in ls] for p, ls in losses.items()})
    for p in ("bf16", "fp8-block"):
        assert losses[p][-1] < losses[p][0]
        assert abs(losses[p][-1] - losses["fp32"][-1]) < 0.01 * losses["fp32"][-1]


def test_fp16_without_scaling_stalls_under_sgd_and_the_scaler_trains_like_fp32():
    """SGD, the loss weighted by 2^-16 (a mean over many elements, module docstring of
    engine.precision.mixed): exact in fp32 and bf16, every gradient flushed in fp16."""
    steps = 12
    runs = underflow_experiment(steps=steps, rows=128)
    plain = underflow_experiment(steps=3, rows=128, loss_weight=1.0, precisions=("fp32", "bf16"))
    fp32, bf16, fp16, scaled = (runs[p] for p in ("fp32", "bf16", "fp16", "fp16+scaler"))
    print({p: (r.losses[0], r.losses[-1], sum(r.flushed), r.skipped) for p, r in runs.items()})
    # a power of two is exact in fp32 and bf16: the weighted runs are the unweighted ones
    assert fp32.losses[:3] == plain["fp32"].losses and bf16.losses[:3] == plain["bf16"].losses
    assert fp32.losses[-1] < 0.7 * fp32.losses[0]  # it trains: 0.566 -> 0.352 (measured)
    # fp16 without scaling: every gradient element flushed at every step, the loss frozen
    psi = sum(p.numel() for p in small_mlp(4, 32).parameters())
    assert fp16.flushed == [psi] * steps and fp16.losses == [fp16.losses[0]] * steps
    # with the scaler: at most 1 element flushed in 12 steps (measured; an fp32 gradient that small is
    # rare), no overflow here, the loss within 1e-4 of fp32's at every step (fp16 rounds the
    # forward: not bit-identical); bf16 within 1e-3
    assert sum(scaled.flushed) < sum(fp16.flushed) / 10_000 and scaled.skipped == 0
    assert scaled.losses == pytest.approx(fp32.losses, rel=1e-4)
    assert bf16.losses == pytest.approx(fp32.losses, rel=1e-3)
