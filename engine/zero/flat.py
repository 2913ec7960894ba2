"""Flat, padded, evenly sharded parameter buckets: the shard math every ZeRO stage uses.

Parameters are packed, last layer first, into buckets of about ``bucket_cap_mb`` (the same
order as data parallelism's gradient buckets, so a bucket's gradients are complete early in
backward). Each bucket is one flat tensor padded with zeros to a multiple of N, and each
parameter's ``.data`` becomes a view into it. Rank r owns the r-th of N equal slices of every
bucket, so every rank holds (numel + padding) / N elements: even shards whatever the element
count (Rajbhandari et al., ZeRO, SC 2020, section 5; PyTorch FSDP's FlatParameter does the
same).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.comm import ops
from engine.dp.buckets import GradBucket, assign_buckets
from engine.validation import positive_number


class ShardedBucket(GradBucket):
    """A gradient bucket padded to a multiple of ``world_size``, of which rank ``rank`` owns
    the ``shard_numel`` elements from ``rank * shard_numel``. Its gradients are
    reduce-scattered: each rank receives the average over ranks of its own slice (ZeRO-2 and
    ZeRO-3) and adds it to ``shard_grad``.

    Typed fields a checkpoint reads: ``params``, ``offsets``, ``shapes``, ``padded``,
    ``shard`` (this rank's slice of the parameters, provided by the subclass) and ``master``
    (what the optimizer updates: the shard itself in fp32, else an fp32 copy of it).
    """

    def __init__(self, params: list[nn.Parameter], rank: int, world_size: int,
                 index: int = 0, is_last: bool = False):
        super().__init__(params, index, is_last, pad_to=world_size)
        self.rank, self.world_size = rank, world_size
        self.divide_by = world_size  # the reduced sum is divided by it: an average over ranks
        self.shard_numel = self.padded // world_size
        self.master: nn.Parameter | None = None
        self.shard_grad: torch.Tensor | None = None  # the averaged gradient of the shard
        self.received: torch.Tensor | None = None  # the reduce-scatter's output, in flight

    shard: torch.Tensor

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a bucket-shaped ``flat`` tensor (a view)."""
        lo = self.rank * self.shard_numel
        return flat[lo:lo + self.shard_numel]

    def flatten(self, tensor_of) -> torch.Tensor:
        """A new flat tensor holding ``tensor_of(p)`` at each parameter's place (zeros for
        ``None`` and for the padding)."""
        out = self.new_flat()
        for p in self.params:
            tensor = tensor_of(p)
            if tensor is not None:
                self.view_of(p, out).copy_(tensor)
        return out

    def accumulate_grad(self, p: nn.Parameter) -> None:
        """Add ``p.grad`` into ``buffer`` and drop it: from here only the bucket holds it."""
        if self.buffer is None:
            self.buffer = self.new_flat()
        self.view_of(p, self.buffer).add_(p.grad)
        p.grad = None

    def start_reduce_scatter(self, group):
        """Launch the async reduce-scatter of ``buffer`` (zeros if no gradient came)."""
        if self.buffer is None:  # none of its parameters was used in this backward
            self.buffer = self.new_flat()
        self.received = torch.empty_like(self.shard)
        return ops.reduce_scatter_tensor(self.received, self.buffer, group=group,
                                         async_op=True)

    def add_reduced_grad(self) -> None:
        """Once the reduce-scatter is done: add the average (the sum over ranks divided by
        ``divide_by``) to ``shard_grad``, drop the full gradient."""
        self.shard_grad.add_(self.received.div_(self.divide_by))
        self.buffer = self.received = None


class FlatBucket(ShardedBucket):
    """A ZeRO-1/2 bucket: ``flat`` (padded, every parameter's ``.data`` a view of it) and
    ``shard``, this rank's slice of it."""

    def __init__(self, params: list[nn.Parameter], rank: int, world_size: int,
                 index: int = 0, is_last: bool = False):
        super().__init__(params, rank, world_size, index, is_last)
        self.flat = self.flatten(lambda p: p.detach())
        for p in params:
            p.data = self.view_of(p, self.flat)

    @property
    def shard(self) -> torch.Tensor:
        """This rank's slice of ``flat`` (a view)."""
        return self.shard_of(self.flat)

    def flatten_grads(self) -> torch.Tensor:
        """The parameters' gradients packed like ``flat`` (zeros for missing ones and padding)."""
        return self.flatten(lambda p: p.grad)


class ShardedUnit(ShardedBucket):
    """A ZeRO-3 unit (:class:`engine.zero.stage3.ZeroDataParallel`): its parameters as one flat
    sharded bucket of which a rank keeps ``shard``, gathered whole (``full``, every
    parameter's ``.data`` a view of it) only while needed, else empty."""

    def __init__(self, name: str, params: list[nn.Parameter], rank: int, n: int, index: int):
        super().__init__(params, rank, n, index)
        self.name = name
        # pack the current values, keep 1/N, in the model's precision (what is gathered)
        self.shard = self.shard_of(self.flatten(lambda p: p.detach())).clone()
        # what the optimizer updates: the shard itself (fp32), or an fp32 master copy of it
        self.master = nn.Parameter(self.shard if self.shard.dtype == torch.float32
                                   else self.shard.float())
        self.shard_grad = torch.zeros_like(self.shard)
        self.full: torch.Tensor | None = None
        self.pending = None  # an async gather in flight (prefetch)
        self.free()

    @property
    def full_bytes(self) -> int:
        return self.padded * self.shard.element_size()

    def start_gather(self, group) -> None:
        """Launch the async all-gather of every rank's shard into a new full buffer."""
        buffer = torch.empty(self.padded, dtype=self.shard.dtype, device=self.shard.device)
        work = ops.all_gather_into_tensor(buffer, self.shard.detach(), group=group,
                                          async_op=True)
        self.pending = (buffer, work)

    def finish_gather(self) -> None:
        """Wait for the gather; the parameters become views of the whole unit."""
        (buffer, work), self.pending = self.pending, None
        work.wait()
        self.full = buffer
        for p in self.params:
            p.data = self.view_of(p, self.full)

    def free(self) -> None:
        """Drop the full buffer: the parameters are empty again."""
        self.full = None
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def check_params(params) -> list[nn.Parameter]:
    params = list(params)
    if any(isinstance(p, dict) for p in params):
        raise ValueError("ZeRO here takes a plain list of parameters (one param group); "
                         "got param groups")
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters to shard")
    for i, p in enumerate(params):
        if p.numel() == 0:
            raise ValueError(f"parameter {i} has shape {tuple(p.shape)} and no elements; "
                             "ZeRO shards elements, so remove zero-size parameters")
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) > 1:
        raise ValueError("parameters must share one dtype and device, got "
                         f"{sorted(map(str, kinds))}")
    return params


def make_buckets(params: list[nn.Parameter], bucket_cap_mb: float, rank: int,
                 world_size: int) -> list[FlatBucket]:
    """Pack ``params`` (forward order) into flat buckets, last parameter first."""
    positive_number("bucket_cap_mb", bucket_cap_mb)
    groups = assign_buckets(params, int(bucket_cap_mb * 2**20))
    return [FlatBucket(group, rank, world_size, i, i == len(groups) - 1)
            for i, group in enumerate(groups)]
