"""Exercise ch02.bucketed_ddp: data parallelism with buckets and overlap, the way DDP does it.

The constructor is written for you: it broadcasts the parameters, packs them into buckets in
reverse order (``self.buckets[0]`` holds the last layer's parameters, which backward finishes
first), gives each bucket one flat buffer, and registers ``_on_grad_ready`` as a hook that
autograd calls the moment a parameter's gradient is ready.

Fill in ``_on_grad_ready`` and ``_finish``, save, then run ``check("ch02.bucketed_ddp")`` in
course/02_data_parallel.ipynb (or ``make grade``). The checks train 3 steps of AdamW at world
sizes 2 and 3 with 1, 2 and 3 buckets and compare with one process on the full batch; count
one all-reduce per bucket; and look at the meter's timestamps for a bucket whose all-reduce
started before backward ended.
"""

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)
from torch import nn

from engine.comm import ops  # noqa: F401  (and this)
from engine.dp.buckets import assign_buckets
from engine.dp.data_parallel import EndOfBackward, broadcast_module


class BucketedDataParallel(nn.Module):
    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, group=None):
        super().__init__()
        self.module, self.group = module, group
        broadcast_module(module, group)
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = assign_buckets(params, int(bucket_cap_mb * 2**20))
        self.buffers = [torch.zeros(sum(p.numel() for p in bucket)) for bucket in self.buckets]
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.views = {}  # param -> its slice of its bucket's buffer, shaped like the param
        for bucket, buffer in zip(self.buckets, self.buffers):
            offset = 0
            for p in bucket:
                self.views[p] = buffer[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        self.ready = [set() for _ in self.buckets]  # params of each bucket whose grad is in
        self.works = [None] * len(self.buckets)  # each bucket's async all-reduce, once launched
        self.next_bucket = 0  # launch buckets in order, so every rank's all-reduces pair up
        self._end = EndOfBackward(self._finish)
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def queue_finish(self) -> None:
        """Ask autograd to call ``_finish`` once, when this backward pass is over."""
        self._end.queue()

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        """Called during backward with ``p.grad`` complete. Call ``queue_finish()``, copy the
        gradient into ``self.views[p]``, mark ``p`` ready, then launch every bucket from
        ``self.next_bucket`` on that is complete, in order:
        ``self.works[i] = ops.all_reduce(self.buffers[i], group=self.group, async_op=True)``.
        """
        raise NotImplementedError("ch02.bucketed_ddp: write me")

    def _finish(self) -> None:
        """Called once at the end of backward. Wait for each bucket's all-reduce, turn the sum
        into the mean, copy each slice back into ``p.grad``, and reset ``ready``, ``works`` and
        ``next_bucket`` for the next step.
        """
        raise NotImplementedError("ch02.bucketed_ddp: write me")
