"""Chapter 12's checks catch the mistakes they aim at (tests/test_grading.py proves each passes
on the solution and fails on the stub)."""

from __future__ import annotations

import types
from pathlib import Path

import torch

from engine.grading import run_checks
from solutions import ch12_dim0_shard, ch12_fp8_tiles, ch12_loss_scaler, ch12_newton_schulz

ROOT = Path(__file__).resolve().parent.parent


def _failing(name, impl):
    return {r.name for r in run_checks(name, impl=impl).results if not r.passed}


# -- the loss scaler ----------------------------------------------------------------------------

def _grows_every_step(scale, clean, found_inf, growth_factor=2.0, backoff_factor=0.5,
                      growth_interval=2000):
    if found_inf:
        return scale * backoff_factor, 0, True
    return scale * growth_factor, 0, False


def _no_backoff(scale, clean, found_inf, growth_factor=2.0, backoff_factor=0.5,
                growth_interval=2000):
    if found_inf:
        return scale, 0, True
    return ch12_loss_scaler.update_scale(scale, clean, False, growth_factor, backoff_factor,
                                         growth_interval)


def _count_not_reset(scale, clean, found_inf, growth_factor=2.0, backoff_factor=0.5,
                     growth_interval=2000):
    if found_inf:
        return scale * backoff_factor, clean, True
    return ch12_loss_scaler.update_scale(scale, clean, False, growth_factor, backoff_factor,
                                         growth_interval)


def _no_fp32_ceiling(scale, clean, found_inf, growth_factor=2.0, backoff_factor=0.5,
                     growth_interval=2000):
    if found_inf:
        return scale * backoff_factor, 0, True
    clean += 1
    if clean == growth_interval:
        return scale * growth_factor, 0, False
    return scale, clean, False


def _count_kept_after_refused_growth(scale, clean, found_inf, growth_factor=2.0,
                                     backoff_factor=0.5, growth_interval=2000):
    if found_inf:
        return scale * backoff_factor, 0, True
    clean += 1
    if clean == growth_interval:
        if scale * growth_factor <= torch.finfo(torch.float32).max:
            return scale * growth_factor, 0, False
        return scale, clean, False  # the growth refused, the count not restarted
    return scale, clean, False


def test_loss_scaler_checks_catch_growth_every_step_no_backoff_and_a_count_not_reset():
    assert _failing("ch12.loss_scaler", _grows_every_step) == {
        "grows_after_interval_clean_steps", "refused_growth_still_restarts_the_count",
        "equals_grad_scaler"}
    assert _failing("ch12.loss_scaler", _no_backoff) == {"backs_off_and_skips_on_inf",
                                                         "equals_grad_scaler"}
    assert _failing("ch12.loss_scaler", _count_not_reset) == {"backs_off_and_skips_on_inf",
                                                              "equals_grad_scaler"}
    # the fp32 ceiling: the refused growth and GradScaler's own sequences show it
    assert _failing("ch12.loss_scaler", _no_fp32_ceiling) == {
        "refused_growth_still_restarts_the_count", "equals_grad_scaler"}


def test_the_stubs_promise_that_the_count_still_restarts_after_a_refused_growth_is_checked():
    # issue 42: exercises/ch12_loss_scaler.py promises it; GradScaler's scales alone cannot show
    # it (the scale stays at the ceiling either way), so one check asserts the count
    stub = " ".join((ROOT / "exercises" / "ch12_loss_scaler.py").read_text().split())
    assert "the count still restarts" in stub
    assert _failing("ch12.loss_scaler", _count_kept_after_refused_growth) == {
        "refused_growth_still_restarts_the_count"}


# -- the dim-0 shard and its gather ---------------------------------------------------------------

def _gather_keeping_padding(chunk, rows, group=None):
    n = torch.distributed.get_world_size(group)
    out = torch.empty(n * chunk.shape[0], *chunk.shape[1:], dtype=chunk.dtype)
    from engine.comm import ops
    ops.all_gather_into_tensor(out, chunk.contiguous(), group=group)
    return out  # the padding rows left in


def _chunk_on_dim_1(full, rank, world_size):
    if full.dim() < 2:
        return ch12_dim0_shard.dim0_chunk(full, rank, world_size)
    return ch12_dim0_shard.dim0_chunk(full.transpose(0, 1), rank, world_size).transpose(0, 1)


def _gather_by_all_reduce(chunk, rows, group=None):
    from engine.comm import ops
    n, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    out = torch.zeros(n * chunk.shape[0], *chunk.shape[1:], dtype=chunk.dtype)
    out[rank * chunk.shape[0]:(rank + 1) * chunk.shape[0]] = chunk
    ops.all_reduce(out, group=group)  # right values, n / (n-1) times the bytes... and more
    return out[:rows]


def test_dim0_checks_catch_padding_left_in_a_shard_on_the_wrong_dim_and_an_all_reduce():
    good = ch12_dim0_shard
    module = types.SimpleNamespace
    assert _failing("ch12.dim0_shard", module(dim0_chunk=good.dim0_chunk,
                                              gather_dim0=_gather_keeping_padding)) == {
        "gather_returns_the_unpadded_tensor"}
    assert _failing("ch12.dim0_shard", module(dim0_chunk=_chunk_on_dim_1,
                                              gather_dim0=good.gather_dim0)) == {
        "chunks_hold_the_rows"}
    assert _failing("ch12.dim0_shard", module(dim0_chunk=good.dim0_chunk,
                                              gather_dim0=_gather_by_all_reduce)) == {
        "one_all_gather_of_the_chunk"}


# -- FP8 tiles -----------------------------------------------------------------------------------

def _tiles_variant(whole_tensor=False, qmax=448.0, no_error=False):
    good = ch12_fp8_tiles

    def quantize_tiles(x, tile):
        rows, cols = x.shape
        tr, tc = tile
        if not no_error and (rows % tr or cols % tc):
            raise ValueError(f"a {tr}x{tc} tile does not divide the shape {tuple(x.shape)}")
        blocks = x.float().reshape(rows // tr, tr, cols // tc, tc)
        amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
        if whole_tensor:
            amax = torch.full_like(amax, x.abs().max().item())
        scales = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
        q = (blocks / scales).to(torch.float8_e4m3fn).reshape(x.shape)
        return q, scales[:, 0, :, 0]

    return types.SimpleNamespace(quantize_tiles=quantize_tiles,
                                 dequantize_tiles=good.dequantize_tiles)


def test_fp8_checks_catch_a_whole_tensor_scale_int8s_127_and_a_silent_remainder():
    assert _failing("ch12.fp8_tiles", _tiles_variant(whole_tensor=True)) == {
        "scales_are_tile_amax_over_448", "round_trip_is_e4m3s"}
    assert _failing("ch12.fp8_tiles", _tiles_variant(qmax=127.0)) == {
        "scales_are_tile_amax_over_448", "round_trip_is_e4m3s"}
    assert _failing("ch12.fp8_tiles", _tiles_variant(no_error=True)) == {
        "a_tile_that_does_not_divide_raises"}
    report = run_checks("ch12.fp8_tiles", impl=_tiles_variant(qmax=127.0))
    assert "127, int8's largest value" in report.results[0].message


# -- Newton-Schulz -------------------------------------------------------------------------------

def _ns_variant(coefficients=ch12_newton_schulz.COEFFICIENTS, normalise=True, transpose=True,
                dtype=torch.float32):
    def newton_schulz(g, steps=5):
        a, b, c = coefficients
        tall = transpose and g.size(0) > g.size(1)
        x = (g.T if tall else g).to(dtype)
        if normalise:
            x = x / (x.norm() + 1e-7)
        for _ in range(steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x.T if tall else x
    return newton_schulz


def test_newton_schulz_checks_catch_the_cubic_no_normalisation_and_no_transpose():
    assert _failing("ch12.newton_schulz", _ns_variant((1.5, -0.5, 0.0))) == {
        "matches_muons_iteration", "singular_values_near_one"}
    assert _failing("ch12.newton_schulz", _ns_variant(normalise=False)) == {
        "matches_muons_iteration", "singular_values_near_one"}
    # the same matrix either way (an odd polynomial: X p(X^T X) = p(X X^T) X), at more FLOPs
    assert _failing("ch12.newton_schulz", _ns_variant(transpose=False)) == {
        "uses_the_smaller_gram_matrix"}


def _message(name, impl, check):
    return next(r.message for r in run_checks(name, impl=impl).results if r.name == check)


def test_newton_schulz_failure_names_fp32_for_bf16_and_inf_nan_only_when_not_finite():
    # issue 42: Muon's own code runs the iteration in bf16; copying it was told "(inf/NaN:
    # nothing normalised)" though it normalised. Now each mistake gets its own guidance.
    bf16 = _message("ch12.newton_schulz", _ns_variant(dtype=torch.bfloat16),
                    "matches_muons_iteration")
    assert "fp32" in bf16 and "bfloat16" in bf16 and "inf/NaN" not in bf16
    as_fp32 = _message("ch12.newton_schulz",
                       lambda g, steps=5: _ns_variant(dtype=torch.bfloat16)(g).float(),
                       "matches_muons_iteration")
    assert "fp32" in as_fp32 and "inf/NaN" not in as_fp32  # by its size, about 1e-2
    unnormalised = _message("ch12.newton_schulz", _ns_variant(normalise=False),
                            "matches_muons_iteration")
    assert "inf/NaN" in unnormalised and "Frobenius norm" in unnormalised
    cubic = _message("ch12.newton_schulz", _ns_variant((1.5, -0.5, 0.0)),
                     "matches_muons_iteration")
    assert "inf/NaN" not in cubic and "fp32" not in cubic and "3.4445" in cubic


def test_the_engines_own_answers_are_switched_off_while_graded():
    import engine.optim
    import engine.precision.fp8
    from engine.precision import DynamicLossScaler

    def update_scale(scale, clean, found_inf, growth_factor=2.0, backoff_factor=0.5,
                     growth_interval=2000):
        scaler = DynamicLossScaler(scale, growth_factor, backoff_factor, growth_interval)
        scaler.clean_steps, scaler.found_inf, scaler.stage = clean, {0: found_inf}, {0: "x"}
        scaler.update()  # the engine's rule, looked up when called: blocked
        return scaler.get_scale(), scaler.clean_steps, found_inf

    def quantize_tiles(x, tile):
        q, scales = engine.precision.fp8.quantize(x, tile)
        return q, scales[:, 0, :, 0]

    tiles = types.SimpleNamespace(quantize_tiles=quantize_tiles,
                                  dequantize_tiles=ch12_fp8_tiles.dequantize_tiles)
    for name, impl in (("ch12.newton_schulz", lambda g, steps=5: engine.optim.newton_schulz(g)),
                       ("ch12.loss_scaler", update_scale), ("ch12.fp8_tiles", tiles)):
        results = run_checks(name, impl=impl).results
        assert not any(r.passed for r in results), name
        assert any("engine" in r.message for r in results), name
