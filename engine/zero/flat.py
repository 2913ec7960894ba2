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

import math

import torch
from torch import nn

from engine.comm import ops
from engine.dp.buckets import assign_buckets


class FlatBucket:
    """One bucket: ``flat`` (padded, every parameter a view of it) and this rank's slice."""

    def __init__(self, params: list[nn.Parameter], rank: int, world_size: int):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.padded = math.ceil(self.numel / world_size) * world_size
        self.shard_numel = self.padded // world_size
        self.rank, self.world_size = rank, world_size
        first = params[0]
        self.flat = torch.zeros(self.padded, dtype=first.dtype, device=first.device)
        self.offsets: dict[nn.Parameter, int] = {}
        at = 0
        for p in params:
            self.offsets[p] = at
            self.flat[at:at + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[at:at + p.numel()].view_as(p)
            at += p.numel()

    @property
    def shard(self) -> torch.Tensor:
        """This rank's slice of ``flat`` (a view)."""
        lo = self.rank * self.shard_numel
        return self.flat[lo:lo + self.shard_numel]

    def view_of(self, p: nn.Parameter, buffer: torch.Tensor) -> torch.Tensor:
        """``p``'s place in a bucket-shaped ``buffer`` (e.g. a flat gradient)."""
        at = self.offsets[p]
        return buffer[at:at + p.numel()].view_as(p)

    def flatten_grads(self) -> torch.Tensor:
        """The parameters' gradients packed like ``flat`` (zeros for missing ones and padding)."""
        out = torch.zeros_like(self.flat)
        for p in self.params:
            if p.grad is not None:
                self.view_of(p, out).copy_(p.grad)
        return out


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
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
            or not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
    groups = assign_buckets(params, int(bucket_cap_mb * 2**20))
    return [FlatBucket(group, rank, world_size) for group in groups]


# -- reduce-scattering gradients into shards (stages 2 and 3) ----------------------------------
#
# A "piece" is a FlatBucket (stage 2) or a stage-3 unit: it has ``padded``, ``shard``,
# ``shard_grad`` (this rank's accumulated gradients), ``grad_buffer`` (the full flat gradient
# being filled during backward), ``received``, ``work`` and ``ready``.


def start_reduce_scatter(piece, group) -> None:
    """Launch the async reduce-scatter of ``piece.grad_buffer`` (zeros if no gradient came)."""
    if piece.grad_buffer is None:  # none of its parameters was used in this backward
        piece.grad_buffer = piece.shard.new_zeros(piece.padded)
    piece.received = torch.empty_like(piece.shard)
    piece.work = ops.reduce_scatter_tensor(piece.received, piece.grad_buffer, group=group,
                                           async_op=True)


def finish_reduce_scatter(piece, world_size: int) -> None:
    """Wait, add the average to ``piece.shard_grad``, and drop the full gradient."""
    piece.work.wait()
    piece.shard_grad.add_(piece.received.div_(world_size))
    piece.grad_buffer = piece.received = piece.work = None
    piece.ready.clear()
