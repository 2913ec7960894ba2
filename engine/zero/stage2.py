"""ZeRO stage 2 (P_os+g) as what it adds to stage 1: the gradients sharded too.

Rajbhandari et al., "ZeRO: Memory optimizations toward training trillion parameter models"
(SC 2020), section 5.2. Stage 1 (:class:`engine.zero.ZeroOptimizer`) reduce-scatters the full
gradients once, at the step, so every rank holds all of them through backward. Stage 2 moves
that reduce-scatter into backward, bucket by bucket (:class:`engine.dp.buckets.BucketLauncher`
launches a bucket's as soon as its last gradient is ready, as DDP does with its all-reduce), and
drops each full gradient once it is packed in its bucket: a rank keeps only its 1/N of the
gradients, ``shard_grad``, accumulated over micro-batches until the step. The bytes sent are
stage 1's; only when, and what stays, change.

In a zero-bubble pipeline (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) a linear
layer's weight gradient comes in a W action, after its B and outside autograd: the buckets
holding such weights wait for W (:class:`engine.zero.late.LateGradients`), and each W
reduce-scatters every one of them, as each backward pass reduce-scatters every bucket.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.dp.buckets import NOTHING_LAUNCHED, BucketLauncher
from engine.zero.flat import FlatBucket
from engine.zero.late import LateGradients


class GradientSharding(LateGradients):
    """Stage 2's part of a :class:`engine.zero.ZeroOptimizer`: hooks on the parameters that
    reduce-scatter each bucket during backward into its ``shard_grad``."""

    def __init__(self, buckets: list[FlatBucket], group):
        self.buckets = buckets
        for b in buckets:
            b.shard_grad = torch.zeros_like(b.shard)  # this rank's gradients, accumulated
        self.group = group
        self.launcher = BucketLauncher(buckets, launch=self._launch, finish=self._finish)
        for p in self.launcher.bucket_of:
            p.register_post_accumulate_grad_hook(self.on_grad_ready)

    def on_grad_ready(self, p: nn.Parameter) -> None:
        """``p``'s gradient is complete: into its bucket, and the full gradient is dropped
        (only the bucket holds it, until the bucket's reduce-scatter has sent it). A deferred
        weight comes through B without one (W brings it)."""
        if p.grad is not None:
            self.launcher.bucket_of[p].accumulate_grad(p)
        self.launcher.grad_ready(p)

    def _launch(self, bucket: FlatBucket):
        if self.waits(bucket):  # W reduce-scatters it (reduce_late_grads)
            return NOTHING_LAUNCHED
        return bucket.start_reduce_scatter(self.group)

    def _finish(self, bucket: FlatBucket) -> None:
        if not self.waits(bucket):  # a late bucket keeps its buffer for W
            bucket.add_reduced_grad()

    def shard_grads(self) -> list[torch.Tensor]:
        """This rank's shard of the averaged gradient, per bucket: what the step uses."""
        return [b.shard_grad for b in self.buckets]

    def zero(self) -> None:
        """Start the next accumulation: every ``shard_grad`` back to zero (and nothing left
        waiting for W from a step that failed part-way)."""
        for b in self.buckets:
            b.shard_grad.zero_()
        self.drop_late_grads()

    def late_order(self) -> list[FlatBucket]:
        return self.buckets
