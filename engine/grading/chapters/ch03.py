"""Checks for chapter 03: Top-K with error feedback; drills on choosing a ratio."""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine import theory
from engine.comm import CommMeter
from engine.compress.experiment import train_compressed
from engine.grading.core import CheckFailed, Exercise, run_ranks
from engine.grading.drill import Drill

RATIO = 0.001
STEPS = 150
MARGIN = 0.25  # held-out loss within this of dense; plain Top-K misses it by more than 0.5


class _Bucket:
    def __init__(self, buffer, index=0):
        self.buffer, self.index, self.is_last = buffer, index, True


def _invariant_on_rank(rank, world_size, impl, numel, ratio):
    torch.manual_seed(rank)
    compressor, out = impl(ratio), []
    for _ in range(4):
        grad = torch.randn(numel)
        old = compressor.residuals.get(0)
        old = torch.zeros(numel) if old is None else old.clone()
        bucket = _Bucket(grad.clone())
        with CommMeter() as meter:
            compressor(bucket, None).wait()
        new, sent = compressor.residuals.get(0), compressor.last_sent.get(0)
        holds = new is not None and sent is not None and torch.equal(sent + new, grad + old)
        dense_sum = sent.clone() if sent is not None else torch.zeros(numel)
        dist.all_reduce(dense_sum)
        out.append((holds, int((sent != 0).sum()) if sent is not None else -1,
                    [(e.op, e.payload_bytes, e.bytes_sent) for e in meter.events],
                    torch.allclose(bucket.buffer, dense_sum / world_size, atol=1e-6)))
    return out


def check_error_feedback_invariant(impl):
    for world_size, numel in ((2, 1000), (3, 777)):
        results = run_ranks(_invariant_on_rank, world_size, impl, numel, 0.05, timeout=20)
        for rank, steps in enumerate(results):
            for step, (holds, _, _, averaged) in enumerate(steps):
                if not holds:
                    raise CheckFailed(
                        f"rank {rank}, step {step}: sent + new residual != gradient + old "
                        "residual. Add the old residual first; the new residual is the "
                        "corrected gradient with the sent coordinates set to 0",
                        world_size=world_size, numel=numel)
                if not averaged:
                    raise CheckFailed(f"rank {rank}, step {step}: the bucket does not hold the "
                                      "average of what the ranks sent", world_size=world_size)


def check_sends_k_values_and_k_indices(impl):
    for world_size, numel, ratio in ((2, 1000, 0.05), (3, 777, 0.01), (2, 50, 0.001)):
        k = theory.topk_kept(numel, ratio)
        results = run_ranks(_invariant_on_rank, world_size, impl, numel, ratio, timeout=20)
        for rank, steps in enumerate(results):
            for step, (_, kept, events, _) in enumerate(steps):
                payloads = [(op, size) for op, size, _ in events]
                if payloads != [("all_gather", 4 * k), ("all_gather", 4 * k)]:
                    raise CheckFailed(
                        f"rank {rank}, step {step}: the meter saw {payloads}; with k = "
                        f"ceil(ratio * numel) = {k} (at least 1) it is two all-gathers of "
                        f"{4 * k} bytes: the values and their indices",
                        world_size=world_size, numel=numel, ratio=ratio)
                sent = sum(b for _, _, b in events)
                if sent != theory.topk_bytes_per_rank(numel, ratio, world_size):
                    raise CheckFailed(f"rank {rank} sent {sent} bytes, expected "
                                      f"{theory.topk_bytes_per_rank(numel, ratio, world_size)}")


def _final_loss(spec):
    return run_ranks(train_compressed, 2, spec, STEPS, timeout=60)[0]["test_loss"]


def check_trains_close_to_dense(impl):
    dense = _final_loss("dense")
    ours = _final_loss(lambda: impl(RATIO))
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
