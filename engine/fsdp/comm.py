"""The two collectives of a :class:`engine.fsdp.group.ShardGroup`, one each per module and pass:
every parameter's padded chunk side by side in one buffer (PyTorch FSDP2's ``foreach_all_gather``
and ``foreach_reduce``, Zhao et al. 2023 for the design they replace).

A group of parameters with chunks ``c_1 .. c_k`` (:class:`engine.fsdp.shard.DimZeroShard`) is,
on the wire, an ``n x (c_1 + ... + c_k)`` matrix: row r is what rank r holds, each parameter a
column slice of it. The all-gather sends each rank's row and fills every row; the
reduce-scatter sends the matrix of whole gradients and leaves each rank the sum of its row.
Every collective goes through :mod:`engine.comm.ops`, so a ``CommMeter`` counts it.
"""

from __future__ import annotations

import torch

from engine.comm import ops


def divide_before(n: int) -> int:
    """The power of two (about ``sqrt(n)``) an fp16 gradient is divided by before the sum of
    ``n`` ranks' (PyTorch's FSDP2, ``_get_gradient_divide_factors``)."""
    before = 1
    while n % before == 0 and n / before > before:
        before *= 2
    return before


def _columns(params) -> list[tuple[int, int]]:
    out, offset = [], 0
    for p in params:
        out.append((offset, offset + p.layout.chunk_numel))
        offset += p.layout.chunk_numel
    return out


def all_gather(params, dtype: torch.dtype, group, n: int, out: list[torch.Tensor]) -> None:
    """Every parameter of ``params`` (:class:`engine.fsdp.group.ShardedParam`) whole, in
    ``dtype``, into ``out`` (tensors of their shapes): one all-gather of the padded chunks."""
    columns = _columns(params)
    device = params[0].shard.device
    send = torch.empty(columns[-1][1], dtype=dtype, device=device)
    for p, (lo, hi) in zip(params, columns):
        local = p.shard.detach().reshape(-1)
        send[lo:lo + local.numel()].copy_(local)
        send[lo + local.numel():hi].zero_()
    received = torch.empty(n * send.numel(), dtype=dtype, device=device)
    ops.all_gather_into_tensor(received, send, group=group)
    rows = received.view(n, -1)
    for p, (lo, hi), whole in zip(params, columns, out):
        p.layout.gather_rows(rows[:, lo:hi], whole)


def pack(params, grads, buffer: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Add the whole gradients ``grads`` (``None``: none came) into ``buffer``, the
    ``n x chunks`` matrix a reduce-scatter sends (``None``: a new one of zeros)."""
    fresh = buffer is None
    if fresh:
        buffer = torch.empty(params[0].layout.world_size, sum(p.layout.chunk_numel
                                                              for p in params),
                             dtype=dtype, device=params[0].shard.device)
    for p, g, (lo, hi) in zip(params, grads, _columns(params)):
        if g is not None:
            p.layout.scatter_rows(g, buffer[:, lo:hi], add=not fresh)
        elif fresh:
            buffer[:, lo:hi].zero_()
    return buffer


def reduce_scatter(params, buffer: torch.Tensor, group) -> list[torch.Tensor]:
    """This rank's rows of the mean over the ranks of ``buffer`` (from :func:`pack`), one
    gradient per parameter, each in its shard's dtype and shape. Summed, then divided by
    ``n``; in fp16, as PyTorch does, divided by a power of two before the sum and by the rest
    after, so that the sum does not overflow."""
    n = buffer.shape[0]
    before = divide_before(n) if buffer.dtype == torch.float16 else 1
    if before != 1:
        buffer /= before
    mine = torch.empty(buffer.shape[1], dtype=buffer.dtype, device=buffer.device)
    ops.reduce_scatter_tensor(mine, buffer.view(-1), group=group)
    mine /= n / before
    # copies, even in the same dtype: a view would keep all of ``mine`` alive, the padded
    # chunks of every parameter of the group, as the shards' gradients
    return [mine[lo:lo + p.shard.numel()].view(p.shard.shape).to(p.shard.dtype, copy=True)
            for p, (lo, _) in zip(params, _columns(params))]
