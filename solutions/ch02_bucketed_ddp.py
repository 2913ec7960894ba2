"""Reference for exercise ch02.bucketed_ddp."""

import torch
import torch.distributed as dist
from torch import nn

from engine.comm import ops
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
        """Copy the gradient into its bucket; launch every complete bucket, in order."""
        self.queue_finish()
        i = self.bucket_of[p]
        self.views[p].copy_(p.grad)
        self.ready[i].add(p)
        while (self.next_bucket < len(self.buckets)
               and len(self.ready[self.next_bucket]) == len(self.buckets[self.next_bucket])):
            j = self.next_bucket
            self.works[j] = ops.all_reduce(self.buffers[j], group=self.group, async_op=True)
            self.next_bucket += 1

    def _finish(self) -> None:
        """Wait, average, write back, reset."""
        n = dist.get_world_size(self.group)
        for i, bucket in enumerate(self.buckets):
            self.works[i].wait()
            self.buffers[i].div_(n)
            for p in bucket:
                p.grad.copy_(self.views[p])
            self.ready[i].clear()
            self.works[i] = None
        self.next_bucket = 0
