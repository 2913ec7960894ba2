"""Exercise ch04.zero1_step: the ZeRO-1 optimizer step.

The constructor is written: the parameters live in one flat, padded buffer
(``self.bucket.flat``, every parameter a view of it), this rank owns the slice
``self.bucket.shard`` (1/N of it), and the inner optimizer (e.g. Adam) was built on
``self.master``, that slice only, so it keeps 1/N of the optimizer state.

Fill in ``step``, save, then run ``check("ch04.zero1_step")`` in course/04_zero.ipynb (or
``make grade``). The checks train 3 steps at 2 and 3 ranks against DataParallel + Adam, count
the optimizer's state bytes on each rank, and read the meter.
"""

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)
from torch import nn

from engine.comm import ops  # noqa: F401  (and this)
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
        raise NotImplementedError("ch04.zero1_step: write me")
