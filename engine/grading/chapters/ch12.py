"""Checks for chapter 12: the loss scaler's update against torch.amp.GradScaler, FSDP2's padded
dim-0 shard and its gather on real ranks, FP8 tile scaling; drills. Muon's Newton-Schulz is in
:mod:`engine.grading.chapters.ch12_muon`. The drivers that run the learner's code (in
:mod:`engine.grading.chapters.drivers_ch12`) return what they saw; every comparison is here."""

from __future__ import annotations

import functools

import torch
from torch import nn

from engine import theory
from engine.fsdp.shard import DimZeroShard
from engine.grading.chapters.drivers_ch12 import dequantized, gather_on_rank
from engine.grading.core import CheckFailed, Exercise, passed, run_here, run_ranks
from engine.grading.drill import Drill
from engine.precision.fp8 import dequantize, outlier_activations, quantize

# -- ch12.loss_scaler -----------------------------------------------------------------------

# (GradScaler's arguments, steps, the steps whose gradient gets an inf or a NaN)
HIDDEN_SEQUENCES = [
    (dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3),
     24, {2, 3, 9, 10, 11, 17}),
    (dict(init_scale=2.0**16, growth_factor=4.0, backoff_factor=0.25, growth_interval=2),
     12, {0, 5}),
    (dict(init_scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=5),
     16, {4, 9, 10}),  # a count not reset at step 4 would grow at step 5
    (dict(init_scale=2.0**125, growth_factor=2.0, backoff_factor=0.5, growth_interval=1),
     7, {4}),  # growing past fp32's largest value is refused
]


@functools.cache
def grad_scaler_decisions(i: int):
    """``torch.amp.GradScaler``'s scale after each update and whether it skipped each step, on
    hidden sequence ``i``: the gradient at the poisoned steps is inf (NaN at odd ones)."""
    kwargs, steps, poisoned = HIDDEN_SEQUENCES[i]
    p = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([p], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", **kwargs)
    scales, skipped = [], []
    for step in range(steps):
        optimizer.zero_grad()
        scaler.scale(p.sum() * 1e-3).backward()  # finite at every scale up to fp32's max
        if step in poisoned:
            p.grad[0] = float("nan") if step % 2 else float("inf")
        before = p.detach().clone()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(torch.equal(before, p.detach()))
    return scales, skipped


def _decide(impl, scale, clean, found_inf, kwargs):
    got = impl(scale, clean, found_inf, **{k: v for k, v in kwargs.items() if k != "init_scale"})
    if not (isinstance(got, tuple) and len(got) == 3):
        raise CheckFailed("return a tuple (new_scale, new_clean_steps, skip)", scale=scale)
    return float(got[0]), int(got[1]), bool(got[2])


def check_backs_off_and_skips_on_inf(impl):
    kwargs = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=4)
    for scale, clean in ((2.0**16, 0), (1024.0, 3), (8.0, 2)):
        got = _decide(impl, scale, clean, True, kwargs)
        if got != (scale * 0.5, 0, True):
            raise CheckFailed(f"got (scale, clean_steps, skip) = {got}, expected "
                              f"{(scale * 0.5, 0, True)}: an inf/NaN step is skipped, the scale "
                              "times backoff_factor, the count of clean steps back to 0",
                              scale=scale, clean_steps=clean, found_inf=True, **kwargs)


def check_grows_after_interval_clean_steps(impl):
    kwargs = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    for clean, expected in ((0, (256.0, 1, False)), (1, (256.0, 2, False)),
                            (2, (512.0, 0, False))):
        got = _decide(impl, 256.0, clean, False, kwargs)
        if got != expected:
            raise CheckFailed(f"got (scale, clean_steps, skip) = {got}, expected {expected}: a "
                              "clean step is taken and counted; only the growth_interval-th in "
                              "a row grows the scale (and the count restarts)", scale=256.0,
                              clean_steps=clean, found_inf=False, **kwargs)


def check_refused_growth_still_restarts_the_count(impl):
    """GradScaler's rule (``_amp_update_scale_``): at the ``growth_interval``-th clean step the
    count restarts whether or not the grown scale is finite in fp32."""
    kwargs = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    top = 2.0**127  # times 2 is past fp32's largest value, about 3.4e38
    got = _decide(impl, top, 2, False, kwargs)
    if got != (top, 0, False):
        raise CheckFailed(f"got (scale, clean_steps, skip) = {got}, expected {(top, 0, False)}: "
                          "the growth_interval-th clean step would take the scale past fp32's "
                          "largest value, so the scale stays; the count restarts all the same, "
                          "as GradScaler's does", scale=top, clean_steps=2, found_inf=False,
                          **kwargs)
    return passed("the count after a refused growth", 0, scale="2^127")


def check_equals_grad_scaler(impl):
    for i, (kwargs, steps, poisoned) in enumerate(HIDDEN_SEQUENCES):
        scales, skipped = grad_scaler_decisions(i)
        scale, clean = kwargs["init_scale"], 0
        for step in range(steps):
            scale, clean, skip = _decide(impl, scale, clean, step in poisoned, kwargs)
            if (scale, skip) != (scales[step], skipped[step]):
                raise CheckFailed(
                    f"at step {step} GradScaler {'skipped' if skipped[step] else 'took'} the "
                    f"step and its scale became {scales[step]:g}; yours "
                    f"{'skipped' if skip else 'took'} it with scale {scale:g}",
                    steps_with_inf=sorted(poisoned), **kwargs)
    return passed("every scale and skip", "GradScaler's", sequences=len(HIDDEN_SEQUENCES))


# -- ch12.dim0_shard ------------------------------------------------------------------------

HIDDEN_CHUNKS = [((10, 3), 4), ((5, 2), 4), ((3,), 2), ((7, 4, 2), 3), ((2, 6), 3), ((8, 5), 4)]
GATHER_SHAPES = {3: [(10, 3), (7, 4, 2), (2, 6), (5,)], 4: [(10, 3), (5, 2), (3, 4), (6,)]}


def _full(shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def expected_chunk(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    layout = DimZeroShard(full.shape, world_size, rank)
    return layout.padded(layout.take(full)).view(layout.chunk_rows, *full.shape[1:])


def check_chunks_hold_the_rows(module):
    for i, (shape, n) in enumerate(HIDDEN_CHUNKS):
        full = _full(shape, i, torch.bfloat16 if i == 1 else torch.float32)
        for rank in range(n):
            got = module.dim0_chunk(full.clone(), rank, n)
            right = expected_chunk(full, rank, n)
            inputs = dict(shape=shape, world_size=n, rank=rank)
            if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(right.shape):
                raise CheckFailed(f"expected a chunk of shape {tuple(right.shape)}: ceil(rows / "
                                  "world_size) rows on dim 0, the other dims whole", **inputs)
            if got.dtype != full.dtype or not torch.equal(got, right):
                raise CheckFailed(f"the chunk ({got.dtype}) differs: rank r's rows of the "
                                  f"parameter ({full.dtype}), r * chunk onwards, as many as "
                                  "exist, then zeros", **inputs)


def _gather_inputs(world_size: int) -> list:
    """Each parameter of the gather check: its shape and the full tensor (made in the grader,
    which cuts every rank's padded chunk of it with the engine's layout)."""
    return [(tuple(shape), _full(shape, 10 + i)) for i, shape in
            enumerate(GATHER_SHAPES[world_size])]


_last_gather: list = [None, None]  # (module, results): both checks read one run of the ranks


def _gathers(module):
    if _last_gather[0] is not module:
        runs = {}
        for n in GATHER_SHAPES:
            params = _gather_inputs(n)
            chunks = [[(shape, expected_chunk(full, rank, n)) for shape, full in params]
                      for rank in range(n)]
            seen = run_ranks(gather_on_rank, n, module, chunks, timeout=30)
            runs[n] = [[_judged_gather(r, full, chunk, n) for r, (_, full), (_, chunk)
                        in zip(results, params, chunks[rank])]
                       for rank, results in enumerate(seen)]
        _last_gather[:] = [module, runs]
    for n, ranks in _last_gather[1].items():
        for rank, results in enumerate(ranks):
            for result in results:
                yield n, rank, result


def _judged_gather(seen: dict, full: torch.Tensor, chunk: torch.Tensor, n: int) -> dict:
    got = seen["got"]
    return dict(shape=tuple(full.shape), got_shape=seen["got_shape"], ops=seen["ops"],
                ok=got is not None and tuple(got.shape) == tuple(full.shape)
                and torch.equal(got, full),
                expected_bytes=(n - 1) * chunk.numel() * 4)


def check_gather_returns_the_unpadded_tensor(module):
    for n, rank, result in _gathers(module):
        if not result["ok"]:
            shape = result["shape"]
            padded = theory.dim0_padding_rows(shape[0], n) + shape[0]
            why = (f"it has {padded} rows: the padding is still there, keep the first "
                   f"{shape[0]}" if result["got_shape"][:1] == (padded,) else
                   "every rank's chunk side by side in rank order, then the first rows rows")
            raise CheckFailed(f"rank {rank}: gather_dim0 returned shape {result['got_shape']}, "
                              f"expected the full {shape} exactly: {why}", world_size=n)


def check_one_all_gather_of_the_chunk(module):
    for n, rank, result in _gathers(module):
        ops, expected = result["ops"], ("all_gather", result["expected_bytes"])
        if ops != [expected]:
            raise CheckFailed(f"rank {rank}: the meter saw {ops}; expected one all-gather of "
                              f"this rank's chunk, (n-1) x chunk bytes = {expected[1]} B "
                              "(through engine.comm.ops)", world_size=n, shape=result["shape"])
    return passed("one all-gather of (n-1) x chunk bytes", "FSDP2's gather", ranks="3 and 4")


# -- ch12.fp8_tiles -------------------------------------------------------------------------

HIDDEN_TILES = [  # (x, tile)
    (outlier_activations(8, 256, seed=1), (1, 128)),
    (torch.randn(256, 256, generator=torch.Generator().manual_seed(2)), (128, 128)),
    (outlier_activations(16, 64, outlier=1000.0, seed=3), (1, 32)),
    (torch.randn(12, 48, generator=torch.Generator().manual_seed(4)) * 1e-3, (4, 16)),
    (torch.cat([torch.zeros(2, 32), torch.ones(2, 32)]), (2, 32)),  # a block of zeros
]


def _quantized(module, x, tile):
    got = module.quantize_tiles(x.clone(), tile)
    if not (isinstance(got, tuple) and len(got) == 2):
        raise CheckFailed("return (q, scales)", shape=tuple(x.shape), tile=tile)
    return got


def check_scales_are_tile_amax_over_448(module):
    for x, tile in HIDDEN_TILES:
        q, scales = _quantized(module, x, tile)
        _, right = quantize(x, tile)
        right = right[:, 0, :, 0]
        inputs = dict(shape=tuple(x.shape), tile=tile)
        if not isinstance(scales, torch.Tensor) or scales.shape != right.shape:
            raise CheckFailed(f"expected one scale per tile, {tuple(right.shape)}", **inputs)
        if torch.equal(scales.float(), right):
            continue
        ratio, first = (scales.float() / right).median().item(), scales.flatten()[0]
        why = ("the scale divides by 127, int8's largest value; E4M3's is 448"
               if abs(ratio - 448 / 127) < 1e-3 else "one scale for the whole tensor: each "
               "tile needs its own amax" if bool((scales == first).all()) else
               "each tile's scale is its largest |value| / 448 (1 for a tile of zeros)")
        raise CheckFailed(f"the scales differ: {why}", **inputs)
    return passed("scale = tile amax / 448", "DeepSeek-V3's", cases=len(HIDDEN_TILES))


def check_round_trip_is_e4m3s(module):
    for x, tile in HIDDEN_TILES:
        q, scales = _quantized(module, x, tile)
        inputs = dict(shape=tuple(x.shape), tile=tile)
        right_q, right_scales = quantize(x, tile)
        if getattr(q, "dtype", None) != torch.float8_e4m3fn or not torch.equal(
                q.float(), right_q.float()):
            raise CheckFailed(f"q ({getattr(q, 'dtype', type(q))}) differs from each tile "
                              "divided by its scale, cast to torch.float8_e4m3fn", **inputs)
        back = run_here(dequantized, module, right_q.view(torch.uint8).clone(),
                        right_scales[:, 0, :, 0].clone(), tile)
        if not (isinstance(back, torch.Tensor) and torch.equal(
                back.float(), dequantize(right_q, right_scales))):
            raise CheckFailed("dequantize_tiles differs: each tile of q.float() times its "
                              "scale, shaped as q", **inputs)


def check_a_tile_that_does_not_divide_raises(module):
    for shape, tile in (((4, 200), (1, 128)), ((100, 256), (128, 128))):
        try:
            module.quantize_tiles(torch.randn(shape), tile)
        except ValueError as e:
            if all(str(v) in str(e) for v in (*shape, *tile)):
                continue
            raise CheckFailed(f"the ValueError says {str(e)!r}: name the tile and the shape",
                              shape=shape, tile=tile) from None
        raise CheckFailed("no ValueError: a tile that does not divide the shape must raise "
                          "one (silently dropping the remainder loses values)",
                          shape=shape, tile=tile)


EXERCISES = [
    Exercise(
        name="ch12.loss_scaler",
        title="The dynamic loss scaler's update, as GradScaler decides",
        module="ch12_loss_scaler",
        attr="update_scale",
        checks=(check_backs_off_and_skips_on_inf, check_grows_after_interval_clean_steps,
                check_refused_growth_still_restarts_the_count, check_equals_grad_scaler),
        hints=(
            "Two cases. An overflow (found_inf): skip the step, shrink the scale, forget the "
            "run of clean steps. A clean step: count it; after growth_interval of them in a "
            "row, grow the scale and start counting again.",
            "Plain float arithmetic; torch.finfo(torch.float32).max is the largest scale.",
            "if found_inf: return scale * backoff_factor, 0, True; clean_steps += 1; if "
            "clean_steps == growth_interval: grow (when scale * growth_factor <= fp32's max), "
            "clean_steps = 0; return scale, clean_steps, False.",
        ),
        blocks=("engine.precision.loss_scaler.DynamicLossScaler.update",
                "engine.theory.loss_scale_after"),
    ),
    Exercise(
        name="ch12.dim0_shard",
        title="FSDP2's padded dim-0 shard and its gather",
        module="ch12_dim0_shard",
        attr="",
        checks=(check_chunks_hold_the_rows, check_gather_returns_the_unpadded_tensor,
                check_one_all_gather_of_the_chunk),
        hints=(
            "Every rank's chunk has the same number of rows, ceil(rows / n), so that one "
            "all-gather of equal chunks rebuilds the parameter; the last ranks pad with zeros, "
            "and the gather cuts the padding off again.",
            "-(-rows // n) is the ceiling; full[r * chunk:(r + 1) * chunk] may be short or "
            "empty; torch.zeros(chunk, *full.shape[1:], dtype=full.dtype); "
            "ops.all_gather_into_tensor(out, chunk, group=group) with out n times the chunk.",
            "dim0_chunk: out = zeros(chunk, ...); mine = full[r*chunk:(r+1)*chunk]; "
            "out[:len(mine)] = mine. gather_dim0: n = dist.get_world_size(group); out = "
            "torch.empty(n * chunk.shape[0], *chunk.shape[1:]); all_gather_into_tensor; "
            "return out[:rows].",
        ),
        blocks=("engine.fsdp.api.gather_full", "engine.fsdp.shard.DimZeroShard.padded",
                "engine.fsdp.shard.DimZeroShard.unpad", "engine.fsdp.api.full_state_dict"),
    ),
    Exercise(
        name="ch12.fp8_tiles",
        title="FP8 E4M3 with one scale per tile",
        module="ch12_fp8_tiles",
        attr="",
        checks=(check_scales_are_tile_amax_over_448, check_round_trip_is_e4m3s,
                check_a_tile_that_does_not_divide_raises),
        hints=(
            "Cut x into tr x tc blocks; each block gets the scale that maps its largest "
            "magnitude onto E4M3's largest value, so an outlier only costs its own block.",
            "x.reshape(rows // tr, tr, cols // tc, tc) puts the blocks on dims 0 and 2; "
            ".abs().amax(dim=(1, 3), keepdim=True); torch.finfo(torch.float8_e4m3fn).max is "
            "448; .to(torch.float8_e4m3fn) casts.",
            "check rows % tr and cols % tc first (ValueError naming both); blocks = "
            "x.float().reshape(...); amax = ...; scales = where(amax > 0, amax / 448, 1); q = "
            "(blocks / scales).to(e4m3).reshape(x.shape); return q, scales[:, 0, :, 0]. "
            "dequantize: reshape q.float() the same way, times scales[:, None, :, None].",
        ),
        blocks=("engine.precision.fp8.quantize", "engine.precision.fp8.dequantize"),
    ),
]

DRILLS = [  # questions from engine.drill's bank: the answers are computed, not typed
    Drill("ch12.bytes_per_parameter", "mp-bytes-per-parameter"),
    Drill("ch12.fp8_all_gather", "fp8-all-gather-bytes"),
    Drill("ch12.newton_schulz_flops", "muon-ns-flops"),
    Drill("ch12.selective_recompute", "selective-recompute-saving"),
]
