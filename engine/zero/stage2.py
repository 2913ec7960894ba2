"""ZeRO stage 2 (P_os+g) as what it adds to stage 1: the gradients sharded too.

Rajbhandari et al., "ZeRO: Memory optimizations toward training trillion parameter models"
(SC 2020), section 5.2. Stage 1 (:class:`engine.zero.ZeroOptimizer`) reduce-scatters the full
gradients once, at the step, so every rank holds all of them through backward. Stage 2 moves
that reduce-scatter into backward, bucket by bucket (:class:`engine.grad_buckets.BucketLauncher`
launches a bucket's as soon as its last gradient is ready, as DDP does with its all-reduce), and
drops each full gradient once it is packed in its bucket: a rank keeps only its 1/N of the
gradients, ``shard_grad``, accumulated over micro-batches until the step. The bytes sent are
stage 1's; only when, and what stays, change.

In a zero-bubble pipeline (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) a linear
layer's weight gradient comes in a W action, after its B and outside autograd:
:meth:`GradientSharding.defer_gradients` names those parameters; B leaves their buckets'
gradients in the buffer, W adds ``dW = dY^T X`` to it (:meth:`~GradientSharding.add_late_grad`)
and :meth:`~GradientSharding.reduce_late_grads` reduce-scatters it: one reduce-scatter per
micro-batch and chunk, as B's under 1F1B.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.grad_buckets import NOTHING_LAUNCHED, BucketLauncher
from engine.zero.flat import FlatBucket


class GradientSharding:
    """Stage 2's part of a :class:`engine.zero.ZeroOptimizer`: hooks on the parameters that
    reduce-scatter each bucket during backward into its ``shard_grad``."""

    def __init__(self, buckets: list[FlatBucket], group):
        self.buckets = buckets
        for b in buckets:
            b.shard_grad = torch.zeros_like(b.shard)  # this rank's gradients, accumulated
        self.group = group
        self.late_buckets: list[FlatBucket] = []  # reduced after W (defer_gradients)
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
        if bucket in self.late_buckets:  # W reduce-scatters it (reduce_late_grads)
            return NOTHING_LAUNCHED
        return bucket.start_reduce_scatter(self.group)

    def _finish(self, bucket: FlatBucket) -> None:
        if bucket not in self.late_buckets:  # a late bucket keeps its buffer for W
            bucket.add_reduced_grad()

    # -- gradients that arrive outside autograd (a zero-bubble pipeline's W actions) ---------

    def defer_gradients(self, params) -> None:
        """The buckets holding ``params`` get (some of) their gradients outside autograd,
        through :meth:`add_late_grad`: the end of a backward leaves their buffers for
        :meth:`reduce_late_grads`."""
        late = {self.launcher.bucket_of[p] for p in params if p in self.launcher.bucket_of}
        self.late_buckets = [b for b in self.buckets if b in late]  # one order on every rank

    def add_late_grad(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """Add ``grad`` (``p``'s shape) to ``p``'s place in its bucket's gradient buffer."""
        bucket = self.launcher.bucket_of.get(p)
        if bucket not in self.late_buckets:
            raise ValueError(f"a gradient of shape {tuple(grad.shape)} came outside autograd "
                             "for a parameter not declared with defer_gradients (its bucket "
                             "was reduce-scattered already)")
        if bucket.buffer is None:
            bucket.buffer = bucket.new_flat()
        bucket.view_of(p, bucket.buffer).add_(grad)

    def reduce_late_grads(self) -> None:
        """Reduce-scatter every late bucket holding gradients, in the buckets' order (the
        same on every rank of the group), into its ``shard_grad``."""
        for bucket in self.late_buckets:
            if bucket.buffer is not None:
                bucket.start_reduce_scatter(self.group).wait()
                bucket.add_reduced_grad()

    def shard_grads(self) -> list[torch.Tensor]:
        """This rank's shard of the averaged gradient, per bucket: what the step uses."""
        return [b.shard_grad for b in self.buckets]

    def zero(self) -> None:
        """Start the next accumulation: every ``shard_grad`` back to zero."""
        for b in self.buckets:
            b.shard_grad.zero_()
