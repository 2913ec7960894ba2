"""Data parallelism from scratch: every rank holds the whole model and averages gradients.

``NaiveDataParallel`` all-reduces each gradient, one at a time, once backward is done.
``DataParallel`` does what ``torch.nn.parallel.DistributedDataParallel`` does (Li et al., VLDB
2020): gradients are packed into buckets in reverse order (:mod:`engine.dp.buckets`), a hook on
each parameter's gradient accumulation notices when a bucket is complete, and that bucket's
all-reduce starts at once, asynchronously, while backward goes on computing earlier layers. At
the end of backward (an autograd callback, no call needed from the user) every bucket is
waited on and the averaged gradients are written back to ``param.grad``.

Buckets are launched strictly in bucket order on every rank, so the ranks' collectives always
pair up, even when a parameter is unused on some ranks (its gradient counts as zero).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn

from engine.comm import ops
from engine.dp.buckets import assign_buckets


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


class EndOfBackward:
    """Runs ``fn`` once when the current backward pass finishes (queued from a grad hook)."""

    def __init__(self, fn):
        self.fn, self.queued = fn, False

    def queue(self) -> None:
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._run)

    def _run(self) -> None:
        self.queued = False
        self.fn()


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


class _Bucket:
    """One bucket: a flat gradient buffer and each parameter's view of it. Compressors get
    this object (``index``, ``is_last``, ``buffer``, ``params``, ``views``), as PyTorch's comm
    hooks get a ``GradBucket``."""

    def __init__(self, index: int, params: list[nn.Parameter], is_last: bool):
        self.index, self.params, self.is_last = index, params, is_last
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                  device=params[0].device)
        self.views = {}
        offset = 0
        for p in params:
            self.views[p] = self.buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.ready: set[nn.Parameter] = set()
        self.work = None


class DataParallel(nn.Module):
    """Bucketed data parallelism with communication overlapped with backward.

    Args:
        module: the replica; its parameters are broadcast from the group's first rank.
        bucket_cap_mb: close a bucket once it holds this many MB of gradients.
        overlap: start each bucket's all-reduce as soon as it is full (True), or all of them
            after backward (False), to measure what overlap buys.
        compressor: ``None`` (plain all-reduce) or a callable ``(bucket, group) -> work``
            that leaves the *average* over ranks in ``bucket.buffer`` once ``work.wait()``
            returns, like a PyTorch comm hook (:mod:`engine.compress`).
        group: the data-parallel process group (default: the world).
        first_bucket_mb: a smaller first bucket gets communication going sooner (DDP: 1 MB).
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, overlap: bool = True,
                 compressor=None, group=None, first_bucket_mb: float | None = None):
        super().__init__()
        if not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
        if first_bucket_mb is not None and not first_bucket_mb > 0:
            raise ValueError(f"first_bucket_mb must be positive or None, got {first_bucket_mb!r}")
        if compressor is not None and not callable(compressor):
            raise ValueError(f"compressor must be None or callable, got {compressor!r}")
        params = [p for p in _checked_params(module) if p.requires_grad]  # frozen: skipped
        self.module, self.group, self.overlap, self.compressor = module, group, overlap, compressor
        broadcast_module(module, group)
        mb = 2**20
        first_cap = int(first_bucket_mb * mb) if first_bucket_mb else None
        groups = assign_buckets(params, int(bucket_cap_mb * mb), first_cap)
        self.buckets = [_Bucket(i, ps, i == len(groups) - 1) for i, ps in enumerate(groups)]
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self._next = 0  # the next bucket to launch: launches go in bucket order on every rank
        self.backward_done_at: float | None = None
        self._sync = True
        self._end = EndOfBackward(self._finish)
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the first backward after the block syncs them all."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # -- during backward ---------------------------------------------------------------------

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._sync:
            return
        self._end.queue()
        bucket = self._bucket_of[p]
        bucket.views[p].copy_(p.grad)
        bucket.ready.add(p)
        if self.overlap:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        while (self._next < len(self.buckets)
               and len(self.buckets[self._next].ready) == len(self.buckets[self._next].params)):
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: _Bucket) -> None:
        if self.compressor is not None:
            bucket.work = self.compressor(bucket, self.group)
        else:
            bucket.work = ops.all_reduce(bucket.buffer, group=self.group, async_op=True)
        self._next += 1

    # -- at the end of backward ----------------------------------------------------------------

    def _finish(self) -> None:
        self.backward_done_at = time.perf_counter()  # for timelines: compute ends here
        for bucket in self.buckets[self._next:]:  # not full: unused parameters, or no overlap
            for p in bucket.params:
                if p not in bucket.ready:
                    if p.grad is not None:  # accumulated earlier, not touched this pass
                        bucket.views[p].copy_(p.grad)
                    else:
                        bucket.views[p].zero_()
            self._launch(bucket)
        n = dist.get_world_size(self.group)
        for bucket in self.buckets:
            bucket.work.wait()
            if self.compressor is None:  # a compressor leaves the average already
                bucket.buffer.div_(n)
            for p in bucket.params:
                if p.grad is None:
                    p.grad = bucket.views[p].clone()
                else:
                    p.grad.copy_(bucket.views[p])
            bucket.ready.clear()
            bucket.work = None
        self._next = 0
