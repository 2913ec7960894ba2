"""Reference for exercise ch04.zero1_step."""

import torch
import torch.distributed as dist
from torch import nn

from engine.comm import ops
from engine.zero.flat import FlatBucket


class Zero1:
    def __init__(self, params, optimizer_cls, group=None, **kwargs):
        params = list(params)
        self.group = group
        self.bucket = FlatBucket(params, dist.get_rank(group), dist.get_world_size(group))
        ops.broadcast(self.bucket.flat, ops.group_ranks(group)[0], group)
        self.master = nn.Parameter(self.bucket.shard.detach())  # shares the flat buffer
        self.inner = optimizer_cls([self.master], **kwargs)
        self.params = params

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """After ``loss.backward()`` on every rank:

        1. ``full = self.bucket.flatten_grads()``: this rank's gradients, packed like ``flat``;
        2. reduce-scatter ``full`` into a tensor shaped like ``self.bucket.shard``
           (``ops.reduce_scatter_tensor(out, full, group=self.group)``) and divide by N: the
           average gradient of the slice this rank owns;
        3. set ``self.master.grad`` to it and call ``self.inner.step()``;
        4. all-gather every rank's updated slice back into ``self.bucket.flat``
           (``ops.all_gather_into_tensor(self.bucket.flat, <a copy of the shard>, ...)``), so
           that every rank's parameters are whole and equal again.
        """
        full = self.bucket.flatten_grads()
        mine = torch.empty_like(self.bucket.shard)
        ops.reduce_scatter_tensor(mine, full, group=self.group)
        self.master.grad = mine.div_(dist.get_world_size(self.group))
        self.inner.step()
        self.master.grad = None
        ops.all_gather_into_tensor(self.bucket.flat, self.bucket.shard.clone(), group=self.group)
