"""Checks for chapter 03: Top-K with error feedback; drills on choosing a ratio.

The ranks that run the learner's code (the ``_on_rank`` drivers) return what they observed:
residuals, what was sent, the bucket afterwards, the meter's events, the held-out loss. The
references (the dense run, the engine's PowerSGD) run in ranks the grader starts without the
learner's code, and every comparison happens in the grader.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn

from engine import theory
from engine.observe.meter import CommMeter
from engine.labs.compression import train_compressed
from engine.compress.powersgd import PowerSGD, orthogonalize
from engine.dp.buckets import GradBucket
from engine.grading.core import CheckFailed, Exercise, passed, run_ranks
from engine.grading.drill import Drill

RATIO = 0.001
STEPS = 150
MARGIN = 0.25  # held-out loss within this of dense; plain Top-K misses it by more than 0.5
INVARIANT_STEPS = 4


class _Bucket:
    def __init__(self, buffer, index=0):
        self.buffer, self.index, self.is_last = buffer, index, True


def _topk_gradients(world_size: int, numel: int) -> list[list[torch.Tensor]]:
    """Each rank's gradient at each step (made in the grader, sent to the ranks)."""
    out = []
    for rank in range(world_size):
        generator = torch.Generator().manual_seed(rank)
        out.append([torch.randn(numel, generator=generator) for _ in range(INVARIANT_STEPS)])
    return out


def _clone(t):
    return t.clone() if isinstance(t, torch.Tensor) else None


def _invariant_on_rank(rank, world_size, impl, ratio, gradients):
    """A driver: four steps of the learner's compressor on one bucket; at each, the residual
    before and after, what it sent, the bucket afterwards and the meter's events."""
    torch.manual_seed(rank)
    compressor, out = impl(ratio), []
    for grad in gradients[rank]:
        old = _clone(compressor.residuals.get(0))
        bucket = _Bucket(grad.clone())
        with CommMeter() as meter:
            compressor(bucket, None).wait()
        out.append(dict(old=old, new=_clone(compressor.residuals.get(0)),
                        sent=_clone(compressor.last_sent.get(0)), bucket=bucket.buffer.clone(),
                        events=[(e.op, e.payload_bytes, e.bytes_sent) for e in meter.events]))
    return out


def _run_invariant(impl, world_size, numel, ratio):
    gradients = _topk_gradients(world_size, numel)
    results = run_ranks(_invariant_on_rank, world_size, impl, ratio, gradients, timeout=20)
    return gradients, results


def check_error_feedback_invariant(impl):
    for world_size, numel in ((2, 1000), (3, 777)):
        gradients, results = _run_invariant(impl, world_size, numel, 0.05)
        for rank, steps in enumerate(results):
            for step, seen in enumerate(steps):
                grad, old, new, sent = (gradients[rank][step], seen["old"], seen["new"],
                                        seen["sent"])
                old = torch.zeros(numel) if old is None else old
                if not (new is not None and sent is not None
                        and torch.equal(sent + new, grad + old)):
                    raise CheckFailed(
                        f"rank {rank}, step {step}: sent + new residual != gradient + old "
                        "residual. Add the old residual first; the new residual is the "
                        "corrected gradient with the sent coordinates set to 0",
                        world_size=world_size, numel=numel)
                dense_sum = sum(torch.zeros(numel) if other[step]["sent"] is None
                                else other[step]["sent"] for other in results)
                if not torch.allclose(seen["bucket"], dense_sum / world_size, atol=1e-6):
                    raise CheckFailed(f"rank {rank}, step {step}: the bucket does not hold the "
                                      "average of what the ranks sent", world_size=world_size)


def check_sends_k_values_and_k_indices(impl):
    for world_size, numel, ratio in ((2, 1000, 0.05), (3, 777, 0.01), (2, 50, 0.001)):
        k = theory.topk_kept(numel, ratio)
        _, results = _run_invariant(impl, world_size, numel, ratio)
        for rank, steps in enumerate(results):
            for step, seen in enumerate(steps):
                payloads = [(op, size) for op, size, _ in seen["events"]]
                if payloads != [("all_gather", 4 * k), ("all_gather", 4 * k)]:
                    raise CheckFailed(
                        f"rank {rank}, step {step}: the meter saw {payloads}; with k = "
                        f"ceil(ratio * numel) = {k} (at least 1) it is two all-gathers of "
                        f"{4 * k} bytes: the values and their indices",
                        world_size=world_size, numel=numel, ratio=ratio)
                sent = sum(b for _, _, b in seen["events"])
                if sent != theory.topk_bytes_per_rank(numel, ratio, world_size):
                    raise CheckFailed(f"rank {rank} sent {sent} bytes, expected "
                                      f"{theory.topk_bytes_per_rank(numel, ratio, world_size)}")


def _train_topk_on_rank(rank, world_size, impl, ratio, steps):
    """A driver: chapter 03's training run with the learner's compressor; its held-out loss."""
    return train_compressed(rank, world_size, functools.partial(impl, ratio),
                            steps)["test_loss"]


@functools.lru_cache(maxsize=None)
def _dense_loss(steps: int) -> float:
    """The same run without compression, in ranks the grader starts (the reference)."""
    return run_ranks(train_compressed, 2, "dense", steps, timeout=60)[0]["test_loss"]


def check_trains_close_to_dense(impl):
    dense = _dense_loss(STEPS)
    ours = run_ranks(_train_topk_on_rank, 2, impl, RATIO, STEPS, timeout=60)[0]
    if not ours <= dense + MARGIN:
        raise CheckFailed(
            f"after {STEPS} steps at ratio {RATIO} the held-out loss is {ours:.3f}, dense "
            f"reaches {dense:.3f}: more than {MARGIN} apart. Is the residual carried to the "
            "next step?", world_size=2, ratio=RATIO)


EXERCISES = [
    Exercise(
        name="ch03.topk_error_feedback",
        title="Top-K with error feedback",
        module="ch03_topk_error_feedback",
        attr="TopKWithErrorFeedback",
        checks=(check_error_feedback_invariant, check_sends_k_values_and_k_indices,
                check_trains_close_to_dense),
        hints=(
            "Send only the k largest coordinates, but forget nothing: what was not sent this "
            "step is added to the next step's gradient, so every coordinate is sent eventually.",
            "k = max(1, math.ceil(ratio * numel)); tensor.abs().topk(k).indices picks the "
            "coordinates; indexing with them gives the values; clone before zeroing so "
            "`gradient` stays untouched.",
            "corrected = gradient (+ residual if there is one); indices = "
            "corrected.abs().topk(k).indices; values = corrected[indices]; new_residual = "
            "corrected.clone(); new_residual[indices] = 0; return values, indices, "
            "new_residual.",
        ),
        blocks=("engine.compress.topk.TopK.__init__", "engine.compress.topk.TopK.select",
                "engine.compress.topk.TopK.__call__"),
    ),
]

DRILLS = [  # questions from engine.drill's bank: the answers are computed, not typed
    Drill("ch03.topk_breakeven_ratio", "topk-breakeven"),
    Drill("ch03.topk_one_percent_bytes", "topk-1-percent"),
    Drill("ch03.without_error_feedback", "ef-optional"),
    Drill("ch03.powersgd_elements", "powersgd-elements"),
]


# -- ch03.powersgd_step -----------------------------------------------------------------------

# (n, m, r): Gram-Schmidt for r <= 2, QR above; every one compressible ((n + m) r 2 < n m)
POWERSGD_SHAPES = [(12, 10, 1), (16, 24, 2), (40, 9, 3)]
POWERSGD_STEPS = 3
POWERSGD_SEED = 5


def _first_q(m: int, r: int) -> torch.Tensor:
    """The engine's first Q for a bucket of one m-column matrix (PowerSGD's warm start
    begins from it): a seeded Gaussian, orthogonalized."""
    rng = np.random.RandomState(POWERSGD_SEED)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(rng.randint(1_000_000_000))
        q = torch.randn(m, r)
    orthogonalize(q)
    return q


def _powersgd_gradients(world_size: int, n: int, m: int) -> list[list[torch.Tensor]]:
    """Each rank's gradient at each step (made in the grader, sent to the ranks)."""
    return [[torch.randn(n, m, generator=torch.Generator().manual_seed(100 * rank + step))
             for step in range(POWERSGD_STEPS)] for rank in range(world_size)]


def _engine_powersgd_on_rank(rank, world_size, n, m, r, gradients):
    """The reference, in ranks started by the grader (never the learner's code): the engine's
    PowerSGD on the same gradients; its approximation, Q and error after each step."""
    engine_psgd = PowerSGD(rank=r, start_iter=0, seed=POWERSGD_SEED)
    bucket = GradBucket([nn.Parameter(torch.zeros(n, m))], index=0, is_last=True)
    steps = []
    for grad in gradients[rank]:
        bucket.buffer = grad.reshape(-1).clone()
        engine_psgd(bucket, None).wait()
        steps.append(dict(approximation=bucket.buffer.view(n, m).clone(),
                          q=engine_psgd.q_memory[0].view(m, r).clone(),
                          error=engine_psgd.errors[0].view(n, m).clone()))
    return steps


def _powersgd_on_rank(rank, world_size, impl, n, m, r, gradients):
    """A driver: the learner's step on this rank's gradients, Q and the error carried over
    (Q orthogonalized before each later step, the engine's warm start); after each step what
    it returned, Q, the error, the gradient it was given and the meter's events."""
    q, error = _first_q(m, r), torch.zeros(n, m)
    steps = []
    for step, grad in enumerate(gradients[rank]):
        if step:
            orthogonalize(q)  # the warm start, as the engine does before each later step
        given = grad.clone()
        with CommMeter() as meter:
            approx = impl(given, q, error)
        steps.append(dict(approximation=_clone(approx), q=q.clone(), error=error.clone(),
                          given=given.clone(), events=[(e.op, e.payload_bytes)
                                                       for e in meter.events]))
    return steps


@functools.lru_cache(maxsize=None)
def _powersgd_reference(world_size: int, n: int, m: int, r: int) -> list[list[dict]]:
    return run_ranks(_engine_powersgd_on_rank, world_size, n, m, r,
                     _powersgd_gradients(world_size, n, m), timeout=20)


def _run_powersgd(impl, world_size):
    for n, m, r in POWERSGD_SHAPES:
        yield n, m, r, run_ranks(_powersgd_on_rank, world_size, impl, n, m, r,
                                 _powersgd_gradients(world_size, n, m), timeout=20)


def check_equals_engine_powersgd(impl):
    for world_size in (2, 3):
        for n, m, r, results in _run_powersgd(impl, world_size):
            reference = _powersgd_reference(world_size, n, m, r)
            gradients = _powersgd_gradients(world_size, n, m)
            for rank, steps in enumerate(results):
                for step, seen in enumerate(steps):
                    expected = reference[rank][step]
                    wrong = [name for name in expected if not (
                        isinstance(seen[name], torch.Tensor)
                        and seen[name].shape == expected[name].shape
                        and torch.allclose(seen[name], expected[name], rtol=1e-5, atol=1e-6))]
                    if wrong:
                        raise CheckFailed(
                            f"rank {rank}, step {step}: {', '.join(wrong)} differ from "
                            "the engine's PowerSGD. M = grad + error; P = M Q summed over ranks "
                            "and orthogonalized; Q = Mᵀ P averaged; approximation P Qᵀ; error "
                            "M - P Qᵀ", world_size=world_size, n=n, m=m, r=r)
                    if not torch.equal(seen["given"], gradients[rank][step]):
                        raise CheckFailed("the gradient passed in was changed: work on a new "
                                          "tensor M = grad + error", n=n, m=m, r=r)


def check_sends_n_plus_m_times_r(impl):
    for n, m, r, results in _run_powersgd(impl, 2):
        expected = 4 * (n + m) * r  # fp32 values of P (n x r) and Q (m x r)
        for rank, steps in enumerate(results):
            for step, seen in enumerate(steps):
                ops_seen = sorted({op for op, _ in seen["events"]})
                payload = sum(size for _, size in seen["events"])
                if ops_seen != ["all_reduce"] or payload != expected:
                    raise CheckFailed(
                        f"rank {rank}, step {step}: the meter saw {seen['events']}, "
                        f"{payload} bytes all-reduced; one step all-reduces P (n x r) and Q "
                        f"(m x r): (n + m) r x 4 = {expected} bytes, never the n x m "
                        f"matrix ({4 * n * m} bytes), through engine.comm.ops", n=n, m=m, r=r)
    return passed(f"all-reduced {(n + m) * r} values instead of {n * m}", "(n + m) r",
                  n=n, m=m, r=r)


EXERCISES.append(Exercise(
    name="ch03.powersgd_step",
    title="PowerSGD's step with error feedback",
    module="ch03_powersgd_step",
    attr="powersgd_step",
    checks=(check_equals_engine_powersgd, check_sends_n_plus_m_times_r),
    hints=(
        "One step of power iteration finds the best rank-r direction of M: P = M Q, then "
        "Q = Mᵀ P. Both are linear in M, so summing P (and averaging Q) over ranks gives the "
        "approximation of the average gradient. Whatever the approximation misses is added "
        "to the next step's gradient.",
        "ops.all_reduce(t, group=group) sums in place; orthogonalize(p) makes p's columns "
        "orthonormal in place; dist.get_world_size(group) is N; q.copy_(...) and "
        "error.copy_(...) overwrite the caller's tensors.",
        "matrix = grad + error; p = matrix @ q; all_reduce(p); orthogonalize(p); "
        "q.copy_(matrix.t() @ p); all_reduce(q); q /= N; approx = p @ q.t(); "
        "error.copy_(matrix - approx); return approx",
    ),
    blocks=("engine.compress.powersgd.PowerSGD.__call__",),
))
