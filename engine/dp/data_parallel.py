"""Data parallelism from scratch: every rank holds the whole model and averages gradients.

``NaiveDataParallel`` all-reduces each gradient, one at a time, once backward is done.
``DataParallel`` does what ``torch.nn.parallel.DistributedDataParallel`` does (Li et al., VLDB
2020, section 3.2): gradients are packed into buckets in reverse order, a hook on each
parameter's gradient accumulation notices when a bucket is complete, and that bucket's
all-reduce starts at once, asynchronously, while backward goes on computing earlier layers. At
the end of backward (an autograd callback, no call needed from the user) every bucket is
waited on and the averaged gradients are written back to ``param.grad``. The buckets and that
launch logic are :mod:`engine.dp.buckets`, shared with ZeRO.

Buckets are launched strictly in bucket order on every rank, so the ranks' collectives always
pair up, even when a parameter is unused on some ranks (its gradient counts as zero).
"""

from __future__ import annotations

import contextlib
import time
import types

import torch
import torch.distributed as dist
from torch import nn

from engine.comm import ops
from engine.dp.buckets import BucketLauncher, EndOfBackward, GradBucket, assign_buckets
from engine.observe.memory import StateTensors, module_state_tensors
from engine.validation import positive_number

# PyTorch's DDP defaults (2.13): 25 MiB buckets, and a first bucket of 1 MiB when the cap is
# left at its default, so that the first all-reduce starts early
DEFAULT_BUCKET_CAP_MB = 25
DEFAULT_FIRST_BUCKET_MB = 1
MB = 2**20


def _checked_params(module: nn.Module) -> list[nn.Parameter]:
    params = list(module.parameters())
    if not params:
        raise ValueError(f"{type(module).__name__} has no parameters: nothing to keep in sync")
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"parameters are on several devices {sorted(map(str, devices))}; "
                         "data parallelism expects the whole replica on one device")
    return params


def broadcast_module(module: nn.Module, group=None) -> None:
    """Make every rank's parameters and buffers equal to those of the group's first rank."""
    src = ops.group_ranks(group)[0]
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            ops.broadcast(tensor.data, src, group)


class NaiveDataParallel(nn.Module):
    """After backward, all-reduce every gradient separately and divide by the world size."""

    def __init__(self, module: nn.Module, group=None):
        super().__init__()
        self.module, self.group = module, group
        self.params = [p for p in _checked_params(module) if p.requires_grad]
        broadcast_module(module, group)
        self._end = EndOfBackward(self._all_reduce_gradients)
        for p in self.params:
            p.register_post_accumulate_grad_hook(lambda _p: self._end.queue())

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _all_reduce_gradients(self) -> None:
        n = dist.get_world_size(self.group)
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            ops.all_reduce(p.grad, group=self.group)
            p.grad.div_(n)


class DataParallel(nn.Module):
    """Bucketed data parallelism with communication overlapped with backward.

    Args:
        module: the replica; its parameters and buffers are broadcast from the group's first
            rank.
        bucket_cap_mb: close a bucket once it holds this many MiB of gradients. ``None``, as in
            PyTorch: 25 MiB, with a first bucket of 1 MiB.
        overlap: start each bucket's all-reduce as soon as it is full (True), or all of them
            after backward (False), to measure what overlap buys.
        compressor: ``None`` (plain all-reduce) or a callable ``(bucket, group) -> work``
            that leaves the *average* over ranks in ``bucket.buffer`` once ``work.wait()``
            returns, like a PyTorch comm hook (:mod:`engine.compress`).
        group: the data-parallel process group (default: the world).
        first_bucket_mb: the first bucket's cap; ``None``: 1 MiB if ``bucket_cap_mb`` is left
            at its default, else ``bucket_cap_mb`` (PyTorch's rule). A smaller first bucket
            gets communication going sooner.
        broadcast_buffers: broadcast the module's buffers (e.g. BatchNorm's running
            statistics) from the group's first rank at the start of each forward, as PyTorch
            does (it skips the forward after one run under ``no_sync()`` or without grad).
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = None,
                 overlap: bool = True, compressor=None, group=None,
                 first_bucket_mb: float | None = None, broadcast_buffers: bool = True):
        super().__init__()
        if first_bucket_mb is not None:
            positive_number("first_bucket_mb", first_bucket_mb)
        if bucket_cap_mb is None:  # PyTorch's rule: the default cap comes with a small first one
            bucket_cap_mb = DEFAULT_BUCKET_CAP_MB
            first_bucket_mb = first_bucket_mb or DEFAULT_FIRST_BUCKET_MB
        positive_number("bucket_cap_mb", bucket_cap_mb)
        if compressor is not None and not callable(compressor):
            raise ValueError(f"compressor must be None or callable, got {compressor!r}")
        params = [p for p in _checked_params(module) if p.requires_grad]  # frozen: skipped
        self.module, self.group, self.overlap, self.compressor = module, group, overlap, compressor
        self.broadcast_buffers = broadcast_buffers
        broadcast_module(module, group)
        self.bucket_cap_bytes = int(bucket_cap_mb * MB)
        self.first_bucket_bytes = int((first_bucket_mb or bucket_cap_mb) * MB)
        groups = assign_buckets(params, self.bucket_cap_bytes, self.first_bucket_bytes)
        self.buckets = [GradBucket(ps, i, i == len(groups) - 1) for i, ps in enumerate(groups)]
        for bucket in self.buckets:
            bucket.buffer = bucket.new_flat()  # kept: every backward writes into it
        self.launcher = BucketLauncher(self.buckets, self._launch, self._average_into_grads,
                                       at_end=self._backward_done)
        self.backward_done_at: float | None = None
        self._sync = True
        self._sync_buffers_next = True
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self._sync_buffers_next:
            src = ops.group_ranks(self.group)[0]
            with torch.no_grad():
                for buffer in self.module.buffers():
                    ops.broadcast(buffer, src, self.group)
        self._sync_buffers_next = torch.is_grad_enabled() and self._sync
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the first backward after the block syncs them all."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def state_tensors(self) -> StateTensors:
        """What this rank holds (see :mod:`engine.observe.memory`): the replica's parameters and
        gradients; as buffers, the bucket buffers (a second copy of the gradients, what
        PyTorch's ``gradient_as_bucket_view=True`` saves) and what the compressor keeps between
        steps (error feedback, warm starts). A compressor object that cannot say what it keeps
        is an error, not a silent 0; a plain function keeps nothing."""
        kept = []
        if self.compressor is not None:
            if hasattr(self.compressor, "state_tensors"):
                kept = list(self.compressor.state_tensors())
            elif not isinstance(self.compressor, types.FunctionType):
                raise TypeError(f"cannot count what the compressor {self.compressor!r} keeps "
                                "between steps: give it a state_tensors() method returning "
                                "its tensors")
        return module_state_tensors(self.module) + \
            StateTensors(buffers=[b.buffer for b in self.buckets] + kept)

    # -- during backward ---------------------------------------------------------------------

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._sync:
            return
        bucket = self.launcher.bucket_of[p]
        bucket.view_of(p, bucket.buffer).copy_(p.grad)
        self.launcher.grad_ready(p, launch=self.overlap)

    def _launch(self, bucket: GradBucket):
        for p in bucket.params:  # launched at the end of backward: some gradients never came
            if p in bucket.ready:
                continue
            if p.grad is not None:  # accumulated earlier, not touched this pass
                bucket.view_of(p, bucket.buffer).copy_(p.grad)
            else:  # unused on this rank: its gradient counts as zero
                bucket.view_of(p, bucket.buffer).zero_()
        if self.compressor is not None:
            return self.compressor(bucket, self.group)
        return ops.all_reduce(bucket.buffer, group=self.group, async_op=True)

    # -- at the end of backward ----------------------------------------------------------------

    def _backward_done(self) -> None:
        self.backward_done_at = time.perf_counter()  # for timelines: compute ends here

    def _average_into_grads(self, bucket: GradBucket) -> None:
        if self.compressor is None:  # a compressor leaves the average already
            bucket.buffer.div_(dist.get_world_size(self.group))
        for p in bucket.params:
            if p.grad is None:
                p.grad = bucket.view_of(p, bucket.buffer).clone()
            else:
                p.grad.copy_(bucket.view_of(p, bucket.buffer))
