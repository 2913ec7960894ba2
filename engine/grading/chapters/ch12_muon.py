"""Checks for chapter 12's Muon exercise: the quintic Newton-Schulz iteration against the
engine's, the singular values it reaches, and the smaller Gram matrix (FLOPs counted by
:mod:`engine.grading.chapters.drivers_ch12`'s driver, where the learner's code runs). Split
from :mod:`engine.grading.chapters.ch12`, which has the chapter's other exercises and its
drills."""

from __future__ import annotations

import torch

from engine import theory
from engine.grading.chapters.drivers_ch12 import flops_on
from engine.grading.core import CheckFailed, Exercise, passed, run_here
from engine.optim.newton_schulz import newton_schulz

# -- ch12.newton_schulz ---------------------------------------------------------------------

HIDDEN_MATRICES = [(32, 64, 1.0), (64, 32, 1.0), (48, 48, 1.0), (128, 40, 1e3), (24, 96, 1e-3),
                   (7, 300, 1.0)]


def _matrix(rows, cols, norm, seed):
    return norm * torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def check_matches_muons_iteration(impl):
    for i, (rows, cols, norm) in enumerate(HIDDEN_MATRICES):
        g = _matrix(rows, cols, norm, i)
        got, right = impl(g.clone()), newton_schulz(g)
        inputs = dict(shape=(rows, cols), frobenius_norm=round(g.norm().item(), 3))
        if not isinstance(got, torch.Tensor) or got.shape != right.shape:
            raise CheckFailed(f"expected a tensor of shape {tuple(right.shape)}", **inputs)
        # the same products associated differently round differently: measured up to 1.2e-6
        # on these matrices (each entry is about 1/sqrt(cols)); 1e-5 leaves room, and any
        # other coefficient, a missing normalisation or a step too few is 1e-2 away or more
        error = (got.float() - right).abs().max().item()
        if not error <= 1e-5:
            raise CheckFailed(_mismatch(got, error), **inputs)
    return passed("max |yours - Muon's| <= 1e-5", "quintic NS5", matrices=len(HIDDEN_MATRICES))


HALF = (torch.bfloat16, torch.float16)


def _mismatch(got: torch.Tensor, error: float) -> str:
    """What a result ``error`` away from Muon's fp32 iteration points to: no normalisation when
    it is not finite; half precision when it is about 1e-2 (Muon's own GPU code runs the
    iteration in bf16) or comes back in it. Measured on the first hidden matrix, where a wrong
    iteration stops: bf16 2.1e-2, fp16 2.9e-3; the cubic 0.13, four or six steps 0.15 and 0.16;
    a coefficient off by 1e-4 about 1e-4."""
    found = f"differs from Muon's iteration by {error:.3g}"
    if not torch.isfinite(got.float()).all():
        return (f"{found}: your result has inf/NaN, which is what skipping the normalisation "
                "does (X X^T grows without bound). Divide by the Frobenius norm first, then "
                "five steps with the quintic's (3.4445, -4.7750, 2.0315)")
    if got.dtype in HALF or 1e-3 <= error < 5e-2:
        return (f"{found}, about what half-precision rounding gives: Muon's GPU code runs the "
                "iteration in bfloat16, these checks compare it in fp32. Compute in fp32 "
                "(x = g.float()) and return fp32")
    return (f"{found}. Normalise by the Frobenius norm first, then five steps with the "
            "quintic's (3.4445, -4.7750, 2.0315)")


def check_singular_values_near_one(impl):
    for i, (rows, cols, norm) in enumerate(HIDDEN_MATRICES):
        if rows == cols:  # a square Gaussian matrix has singular values near 0: skipped
            continue
        got = impl(_matrix(rows, cols, norm, i)).float()
        singular = torch.linalg.svdvals(got.nan_to_num(posinf=1e30, neginf=-1e30))
        if not (singular.min() > 0.6 and singular.max() < 1.25):
            raise CheckFailed(f"singular values in [{singular.min():.3g}, {singular.max():.3g}]"
                              ": five quintic steps bring every one into about [0.68, 1.2]; "
                              "the cubic (1.5, -0.5) is too slow for the small ones, and "
                              "without normalisation they blow up or stay tiny",
                              shape=(rows, cols), scale=norm)


def _flops(impl, g):
    return run_here(flops_on, impl, g.clone())


def check_uses_the_smaller_gram_matrix(impl):
    for rows, cols in ((96, 24), (128, 40)):
        tall = _matrix(rows, cols, 1.0, rows)
        spent, wide = _flops(impl, tall), _flops(impl, tall.T.contiguous())
        least = theory.muon_newton_schulz_flops(rows, cols)
        if spent > wide:  # the same work either way only if a tall matrix is transposed
            raise CheckFailed(f"{spent:,} FLOPs on the tall {rows}x{cols} matrix, {wide:,} on "
                              f"its transpose; forming the {cols}x{cols} Gram matrix costs "
                              f"{least:,}: transpose a tall matrix first so that X X^T is the "
                              "smaller one", shape=(rows, cols))
    return passed("FLOPs on a tall matrix", "5 (4 m^2 n + 2 m^3), m = min", shape="128x40")


EXERCISES = [
    Exercise(
        name="ch12.newton_schulz",
        title="Muon's quintic Newton-Schulz iteration",
        module="ch12_newton_schulz",
        attr="newton_schulz",
        checks=(check_matches_muons_iteration, check_singular_values_near_one,
                check_uses_the_smaller_gram_matrix),
        hints=(
            "An odd polynomial of X keeps its singular vectors and maps each singular value "
            "s to p(s); iterating a steep one pushes every s in (0, 1] towards 1. Normalise "
            "first so that no singular value exceeds 1; work on the wide orientation so that "
            "X X^T is small.",
            "g.norm() is the Frobenius norm; x @ x.T the Gram matrix; .T to transpose (and "
            "back at the end).",
            "a, b, c = COEFFICIENTS; tall = g.size(0) > g.size(1); x = g.float().T if tall "
            "else g.float(); x = x / (x.norm() + 1e-7); for _ in range(steps): A = x @ x.T; "
            "x = a * x + (b * A + c * A @ A) @ x; return x.T if tall else x.",
        ),
        blocks=("engine.optim.newton_schulz.newton_schulz",),
    ),
]
