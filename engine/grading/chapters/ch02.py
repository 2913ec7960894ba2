"""Checks for chapter 02: gradient accumulation, averaging gradients, bucketed DDP.

The ranks that run the learner's code (the ``_on_rank`` drivers, in
:mod:`engine.grading.chapters.drivers_ch02`) return what they observed: parameters, optimizer
moments, the meter's events, gradients, times. The references (one process on the full
batch, the engine's DataParallel) run in ranks the grader starts without the learner's code,
and every comparison happens in the grader.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from engine.observe.meter import CommMeter
from engine.dp import DataParallel
from engine.dp.buckets import assign_buckets
from engine.model.mlp import MLP
from engine.model.data import regression_data
from engine.grading.chapters.drivers_ch02 import (
    DDP_SIZES, SIZES, accumulate_on_rank, adamw, averaging_on_rank, bucketed_on_rank,
    copied_params, make_optimizer, momentum_sgd, overlap_batch, overlap_model, overlap_on_rank)
from engine.grading.core import CheckFailed, Exercise, passed, run_ranks
from engine.grading.drill import Drill

CASES = [(2, 4), (3, 2)]  # (world_size, k)


def _worst(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The largest difference between two lists of parameters (inf when they do not pair)."""
    if len(ours) != len(reference) or any(a.shape != b.shape for a, b in zip(ours, reference)):
        return float("inf")
    return max((a - b).abs().max().item() for a, b in zip(ours, reference, strict=True))


def _full_batch_on_rank(rank, world_size, sizes, seed, make_optimizer, x, y, steps):
    reference = MLP(sizes, seed=seed)
    opt = make_optimizer(reference.parameters())
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        opt.step()
    return copied_params(reference)


def _full_batch(sizes, seed: int, make_optimizer, x, y, steps: int) -> list[torch.Tensor]:
    """The reference: one process training on the whole batch, in a rank the grader starts
    (never the learner's code), single-threaded like the ranks it is compared with."""
    return run_ranks(_full_batch_on_rank, 1, sizes, seed, make_optimizer, x, y, steps,
                     timeout=20)[0]


def _run(impl, world_size, k):
    return run_ranks(accumulate_on_rank, world_size, impl, k, timeout=20)


@functools.lru_cache(maxsize=None)
def _accumulate_reference(world_size: int, k: int) -> list[torch.Tensor]:
    x, y = regression_data(6 * k * world_size, 16, 8, seed=11)
    return _full_batch(SIZES, 2, momentum_sgd, x, y, steps=2)


def check_equals_one_big_batch(impl):
    for world_size, k in CASES:
        reference = _accumulate_reference(world_size, k)
        for rank, (params, _, _) in enumerate(_run(impl, world_size, k)):
            worst = _worst(params, reference)
            if not worst <= 1e-6:
                raise CheckFailed(f"after 2 steps rank {rank}'s parameters differ from one big "
                                  f"batch by {worst:.2e}: is each loss divided by k, and the "
                                  "gradient zeroed first?", world_size=world_size, k=k)


def check_one_all_reduce_per_step(impl):
    for world_size, k in CASES:
        for rank, (_, events, loss) in enumerate(_run(impl, world_size, k)):
            if events != 2:  # one bucket, two optimizer steps
                raise CheckFailed(f"rank {rank} issued {events} all-reduces over 2 steps; "
                                  "with no_sync around all but the last backward it is 2",
                                  world_size=world_size, k=k)
            if not isinstance(loss, float):
                raise CheckFailed(f"return the mean loss as a float, got {loss!r}")


@functools.lru_cache(maxsize=None)
def _averaging_reference(world_size: int, kind: str) -> list[torch.Tensor]:
    x, y = regression_data(8 * world_size, 16, 8, seed=4)
    return _full_batch(SIZES, 2, functools.partial(make_optimizer, kind), x, y, steps=3)


def check_matches_full_batch_training(impl):
    for world_size, kind in ((2, "sgd"), (3, "sgd"), (2, "adam"), (3, "adam")):
        reference = _averaging_reference(world_size, kind)
        results = run_ranks(averaging_on_rank, world_size, impl, kind, timeout=20)
        for rank, (params, _, events) in enumerate(results):
            if not events:
                raise CheckFailed("use ops.all_reduce so the meter sees the averaging")
            worst = _worst(params, reference)
            if not worst <= 1e-6:
                raise CheckFailed(f"after 3 steps rank {rank} differs from one process on the "
                                  f"full batch by {worst:.2e}: average (sum / N) the gradients, "
                                  "before the optimizer step", world_size=world_size,
                                  optimizer=kind)


def check_adam_moments_equal_on_every_rank(impl):
    results = run_ranks(averaging_on_rank, 3, impl, timeout=20)
    for rank, (_, moments, _) in enumerate(results):
        if not torch.equal(moments, results[0][1]):
            raise CheckFailed(f"rank {rank}'s Adam exp_avg differs from rank 0's: its optimizer "
                              "saw a different gradient", world_size=3)


EXERCISES = [
    Exercise(
        name="ch02.accumulate",
        title="Gradient accumulation with no_sync",
        module="ch02_accumulate",
        attr="accumulation_step",
        checks=(check_equals_one_big_batch, check_one_all_reduce_per_step),
        hints=(
            "One optimizer step for k micro-batches: the gradient must be the mean over all of "
            "them, and the ranks need to talk only once, after the last backward.",
            "`with model.no_sync():` keeps a backward's gradients local; dividing each loss by "
            "k turns the accumulated sum into the mean; optimizer.zero_grad() and "
            "optimizer.step() run once each.",
            "zero_grad(); for i, (x, y): loss = loss_fn(model(x), y) / k; backward inside `with "
            "model.no_sync():` unless i is the last; add up loss.item(); step(); return the "
            "sum.",
        ),
        blocks=("engine.compose.loop.accumulate",),
    ),
    Exercise(
        name="ch02.average_gradients",
        title="Average gradients, not parameters",
        module="ch02_average_gradients",
        attr="average_gradients",
        checks=(check_matches_full_batch_training, check_adam_moments_equal_on_every_rank),
        hints=(
            "Every rank must take the step one process would take on the whole batch: its "
            "gradient is the mean of the ranks' gradients. Averaging parameters after local "
            "steps is not the same for Adam.",
            "ops.all_reduce(p.grad, group=group) sums a gradient over the ranks where the meter "
            "sees it; dist.get_world_size(group) is N.",
            "for p in model.parameters(): if p.grad is not None: ops.all_reduce(p.grad, "
            "group=group); p.grad.div_(N).",
        ),
        blocks=("engine.dp.data_parallel.NaiveDataParallel._all_reduce_gradients",),
    ),
]

DRILLS = [  # questions from engine.drill's bank: the answers are computed, not typed
    Drill("ch02.ring_bytes_flat", "dp-comm-linear"),
    Drill("ch02.accumulation_all_reduces", "accumulation-all-reduces"),
    Drill("ch02.effective_batch", "effective-batch"),
]


# -- ch02.bucketed_ddp ------------------------------------------------------------------------

BUCKET_CAPS_MB = {1: 1.0, 2: 5000 / 2**20, 3: 1024 / 2**20}  # buckets -> cap that makes them


def _run_bucketed(impl, world_size, buckets):
    return run_ranks(bucketed_on_rank, world_size, impl, BUCKET_CAPS_MB[buckets], timeout=20)


@functools.lru_cache(maxsize=None)
def _bucketed_reference(world_size: int) -> list[torch.Tensor]:
    x, y = regression_data(4 * world_size, 16, 8, seed=5)
    return _full_batch(DDP_SIZES, 3, adamw, x, y, steps=3)


def check_matches_full_batch_training_bucketed(impl):
    for world_size in (2, 3):
        reference = _bucketed_reference(world_size)
        for buckets in BUCKET_CAPS_MB:
            for rank, (params, _, _) in enumerate(_run_bucketed(impl, world_size, buckets)):
                worst = _worst(params, reference)
                if not worst <= 1e-6:
                    raise CheckFailed(
                        f"after 3 AdamW steps rank {rank}'s parameters differ from one process "
                        f"on the full batch by {worst:.2e}: average (sum / N) every bucket and "
                        "copy each slice back into p.grad", world_size=world_size,
                        buckets=buckets)


def _bucket_bytes(buckets):
    model = MLP(DDP_SIZES, seed=3)
    groups = assign_buckets(list(model.parameters()), int(BUCKET_CAPS_MB[buckets] * 2**20))
    return [sum(p.numel() * p.element_size() for p in g) for g in groups]


def check_one_all_reduce_per_bucket(impl):
    for buckets in BUCKET_CAPS_MB:
        expected = [("all_reduce", size) for size in _bucket_bytes(buckets)]
        for rank, (_, steps, _) in enumerate(_run_bucketed(impl, 2, buckets)):
            for step, events in enumerate(steps):
                seen = [(op, size) for op, size, _ in events]
                if seen != expected:
                    raise CheckFailed(
                        f"rank {rank}, step {step}: the meter saw {seen}; expected one "
                        f"all-reduce per bucket, last layer's bucket first: {expected}. Use "
                        "ops.all_reduce on each bucket's flat buffer, once per backward",
                        buckets=buckets)


def check_first_bucket_overlaps_backward(impl):
    for rank, (_, steps, backward_end) in enumerate(_run_bucketed(impl, 2, 3)):
        events = steps[-1]
        if not events:
            raise CheckFailed("the meter saw no all-reduce; use ops.all_reduce", buckets=3)
        if not events[0][2] < backward_end:
            raise CheckFailed(
                f"rank {rank}: the first bucket's all-reduce started "
                f"{(events[0][2] - backward_end) * 1e3:.2f} ms after the last gradient was "
                "ready. Launch a bucket in _on_grad_ready as soon as it is complete, not in "
                "_finish", buckets=3)


EXERCISES.append(Exercise(
    name="ch02.bucketed_ddp",
    title="Bucketed data parallelism with overlap",
    module="ch02_bucketed_ddp",
    attr="BucketedDataParallel",
    checks=(check_matches_full_batch_training_bucketed, check_one_all_reduce_per_bucket,
            check_first_bucket_overlaps_backward),
    hints=(
        "Gradients arrive last layer first. Copy each into its bucket; the moment a bucket is "
        "complete, start its all-reduce while backward goes on; when backward ends, wait for "
        "every bucket and write the averages back into the gradients.",
        "self.views[p].copy_(p.grad); self.ready[i].add(p); ops.all_reduce(self.buffers[i], "
        "group=self.group, async_op=True) returns a work to .wait() on; self.next_bucket keeps "
        "the launches in order so every rank pairs the same all-reduces; self.queue_finish() "
        "makes autograd call _finish.",
        "_on_grad_ready: queue_finish(); copy; mark ready; while the bucket at next_bucket is "
        "complete: works[j] = async all-reduce; next_bucket += 1. _finish: for each bucket: "
        "wait, divide by N, copy each view into p.grad, clear ready, works[i] = None; "
        "next_bucket = 0.",
    ),
    blocks=("engine.dp.data_parallel.DataParallel.__init__",
            "engine.dp.data_parallel.DataParallel._on_grad_ready",
            "engine.dp.data_parallel.DataParallel._launch",
            "engine.dp.data_parallel.DataParallel._average_into_grads"),
))


# -- ch02.overlap_hook ------------------------------------------------------------------------

# (model, bucket cap in MiB): one parameter per bucket (10 bytes), or one layer per bucket
OVERLAP_CASES = [("mlp", 10 / 2**20), ("detour", 10 / 2**20), ("detour", 100 / 2**20)]


def _overlap_reference_on_rank(rank, world_size, model_name, cap_mb):
    """The reference, in ranks started by the grader (never the learner's code): the engine's
    DataParallel, its gradients after each backward, and one all-reduce per bucket."""
    xs, ys = overlap_batch(rank, world_size)
    reference = DataParallel(overlap_model(model_name, 3), bucket_cap_mb=cap_mb)
    opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    expected = [("all_reduce", b.buffer.numel() * b.buffer.element_size())
                for b in reference.buckets]
    grads = []
    for _ in range(3):
        opt.zero_grad()
        with CommMeter():  # metered, ops run the engine's own collectives, as in the driver
            nn.functional.mse_loss(reference(xs), ys).backward()
        grads.append([p.grad.clone() for p in reference.parameters()])
        opt.step()
    return dict(grads=grads, expected=expected)


def _run_overlap(hook, world_size, model_name, cap_mb):
    return run_ranks(overlap_on_rank, world_size, hook, model_name, cap_mb, timeout=20)


@functools.lru_cache(maxsize=None)
def _overlap_reference(world_size, model_name, cap_mb) -> list[dict]:
    return run_ranks(_overlap_reference_on_rank, world_size, model_name, cap_mb, timeout=20)


def _differ(names, ours, reference) -> list[str]:
    """The parameters whose gradients are not exactly the reference's."""
    if len(ours) != len(reference):
        return list(names)
    return [name for name, a, b in zip(names, ours, reference, strict=True)
            if not (isinstance(a, torch.Tensor) and a.shape == b.shape and torch.equal(a, b))]


def check_equals_engine_data_parallel(hook):
    for world_size in (2, 3):
        for model_name, cap_mb in OVERLAP_CASES:
            names = [name for name, _ in overlap_model(model_name, 3).named_parameters()]
            reference = _overlap_reference(world_size, model_name, cap_mb)
            for rank, steps in enumerate(_run_overlap(hook, world_size, model_name, cap_mb)):
                for step, seen in enumerate(steps):
                    differ = _differ(names, seen["grads"], reference[rank]["grads"][step])
                    if differ:
                        raise CheckFailed(
                            f"rank {rank}, step {step}: the gradients of {differ} "
                            "differ from the engine's DataParallel. Is each p.grad copied into "
                            "its place in the bucket's buffer before the bucket is launched?",
                            world_size=world_size, model=model_name,
                            buckets=len(reference[rank]["expected"]))


def check_launched_in_order_during_backward(hook):
    counts = []
    for model_name, cap_mb in OVERLAP_CASES:
        reference = _overlap_reference(2, model_name, cap_mb)
        for rank, steps in enumerate(_run_overlap(hook, 2, model_name, cap_mb)):
            expected = reference[rank]["expected"]
            for step, seen in enumerate(steps):
                launched = [(op, size) for op, size, _ in seen["events"]]
                if launched != expected:
                    raise CheckFailed(
                        f"rank {rank}, step {step}: the meter saw {launched}; expected one "
                        f"all-reduce per bucket in bucket order: {expected}. A bucket that "
                        "completes early waits for the ones before it", world_size=2,
                        model=model_name)
                late = [i for i, (_, _, start) in enumerate(seen["events"])
                        if not start < seen["backward_end"]]
                if late:
                    raise CheckFailed(
                        f"rank {rank}, step {step}: the all-reduce of bucket(s) {late} started "
                        "after backward ended. Launch each bucket from the hook, as soon as it "
                        "and every bucket before it are complete", world_size=2,
                        model=model_name)
        counts.append(str(len(expected)))
    return passed(f"{' + '.join(counts)} all-reduces, each launched before backward ended",
                  "one per bucket, in bucket order", buckets=", ".join(counts))


EXERCISES.append(Exercise(
    name="ch02.overlap_hook",
    title="DDP's overlap hook: launch each bucket's all-reduce, in order",
    module="ch02_overlap_hook",
    attr="on_grad_ready",
    checks=(check_equals_engine_data_parallel, check_launched_in_order_during_backward),
    hints=(
        "A bucket can go on the wire as soon as all its gradients are in, while backward goes "
        "on computing earlier layers. But every rank must issue its all-reduces in the same "
        "order, so a bucket waits until every bucket before it has been launched.",
        "bucket = bucket_of[p]; bucket.view_of(p, bucket.buffer) is p's place in the flat "
        "buffer; bucket.ready is a set; bucket.complete says all its parameters are ready; "
        "bucket.work is None until launched; launch(bucket) returns the work.",
        "copy p.grad into bucket.view_of(p, bucket.buffer); bucket.ready.add(p); then "
        "for b in buckets: if not b.complete: break; if b.work is None: b.work = launch(b)",
    ),
    blocks=("engine.dp.buckets.BucketLauncher.grad_ready",),
))
