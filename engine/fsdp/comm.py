"""The two collectives of a :class:`engine.fsdp.group.ShardGroup`, one each per module and pass:
every parameter's padded chunk side by side in one buffer (PyTorch FSDP2's ``foreach_all_gather``
and ``foreach_reduce``, Zhao et al. 2023 for the design they replace).

A group of parameters with chunks ``c_1 .. c_k`` (:class:`engine.fsdp.shard.DimZeroShard`) is,
on the wire, an ``n x (c_1 + ... + c_k)`` matrix: row r is what rank r holds, each parameter a
column slice of it (:class:`Columns`, worked out once per group). The all-gather sends each
rank's row and fills every row; the reduce-scatter sends the matrix of whole gradients and
leaves each rank the sum of its row. When no parameter needs padding (every first dimension a
multiple of ``n``, the common case) each copy in and out is one call over the whole group, as
FSDP2's copy-in and ``split_with_sizes_copy`` copy-out are; otherwise one per parameter. Every
collective goes through :mod:`engine.comm.ops`, so a ``CommMeter`` counts it.
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


class Columns:
    """Where each parameter of a group sits in its collectives' ``n x total`` matrix."""

    def __init__(self, params):
        self.params, self.n = params, params[0].layout.world_size
        self.chunks = [p.layout.chunk_numel for p in params]
        self.starts = [sum(self.chunks[:i]) for i in range(len(params))]
        self.total = sum(self.chunks)
        self.even = all(p.layout.rows % self.n == 0 for p in params)  # no padding anywhere
        self.flat = self._one_buffer() if self.even else None

    def _one_buffer(self) -> torch.Tensor | None:
        """An even group's shards moved into one buffer, each a view of it, so the all-gather
        sends the buffer itself (no copy in; FSDP1's flat shard, as
        :class:`engine.zero.flat.ShardedUnit` keeps). Shards of mixed dtypes keep their own."""
        shards = [p.shard for p in self.params]
        if len({(t.dtype, t.device) for t in shards}) != 1:
            return None
        flat = torch.empty(self.total, dtype=shards[0].dtype, device=shards[0].device)
        for t, lo, c in zip(shards, self.starts, self.chunks):
            flat[lo:lo + c].copy_(t.detach().reshape(-1))
            t.data = flat[lo:lo + c].view(t.shape)
        return flat

    def holds_the_shards(self) -> bool:
        """Whether every shard is still a view of :attr:`flat` (a ``module.to(...)`` that
        converted them gives each its own storage again: then they are copied in)."""
        if self.flat is None:
            return False
        ptr = self.flat.untyped_storage().data_ptr()
        return all(p.shard.untyped_storage().data_ptr() == ptr for p in self.params)

    def rows_of(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each whole tensor seen as its ``n x chunk`` rows (even groups only)."""
        return [t.view(self.n, c) for t, c in zip(tensors, self.chunks)]


class Gathering:
    """An all-gather of the group's padded chunks in flight (``async_op``; a prefetch), in
    ``dtype``; :meth:`finish` waits and copies every parameter whole into ``out``."""

    def __init__(self, columns: Columns, dtype: torch.dtype, group, async_op: bool = False):
        params, self.columns = columns.params, columns
        device = params[0].shard.device
        if columns.holds_the_shards():  # their own buffer (a cast only if the policy asks)
            send = columns.flat.to(dtype)
        elif columns.even:
            send = torch.empty(columns.total, dtype=dtype, device=device)
            torch.cat([p.shard.detach().reshape(-1) for p in params], out=send)
        else:
            send = torch.zeros(columns.total, dtype=dtype, device=device)
            for p, lo in zip(params, columns.starts):
                send[lo:lo + p.shard.numel()].copy_(p.shard.detach().reshape(-1))
        self.received = torch.empty(columns.n * columns.total, dtype=dtype, device=device)
        self.work = ops.all_gather_into_tensor(self.received, send, group=group,
                                               async_op=async_op)

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None

    def finish(self, out: list[torch.Tensor], out_rows: list[torch.Tensor] | None = None
               ) -> None:
        """Every parameter whole into ``out`` (tensors of their shapes; ``out_rows``: the same
        as :meth:`Columns.rows_of` gives, kept by the caller)."""
        self.wait()
        columns = self.columns
        rows = self.received.view(columns.n, -1)
        if columns.even:
            torch.split_with_sizes_copy(rows, columns.chunks, dim=1,
                                        out=out_rows or columns.rows_of(out))
            return
        for p, lo, c, whole in zip(columns.params, columns.starts, columns.chunks, out):
            p.layout.gather_rows(rows[:, lo:lo + c], whole)


def all_gather(columns: Columns, dtype: torch.dtype, group, out: list[torch.Tensor],
               out_rows: list[torch.Tensor] | None = None) -> None:
    """Every parameter of the group whole, in ``dtype``, into ``out``: one all-gather of the
    padded chunks (:class:`Gathering`, at once)."""
    Gathering(columns, dtype, group).finish(out, out_rows)


def pack(columns: Columns, grads, buffer: torch.Tensor | None, dtype: torch.dtype
         ) -> torch.Tensor:
    """Add the whole gradients ``grads`` (``None``: none came) into ``buffer``, the
    ``n x total`` matrix a reduce-scatter sends (``None``: a new one of zeros)."""
    params, n = columns.params, columns.n
    device = params[0].shard.device
    if buffer is None and columns.even:
        buffer = torch.empty(n, columns.total, dtype=dtype, device=device)
        torch.cat([g.reshape(n, c) if g is not None else
                   torch.zeros(n, c, dtype=dtype, device=device)
                   for g, c in zip(grads, columns.chunks)], dim=1, out=buffer)
        return buffer
    fresh = buffer is None
    if fresh:
        buffer = torch.empty(n, columns.total, dtype=dtype, device=device)
    for p, g, lo, c in zip(params, grads, columns.starts, columns.chunks):
        if g is not None:
            p.layout.scatter_rows(g, buffer[:, lo:lo + c], add=not fresh)
        elif fresh:
            buffer[:, lo:lo + c].zero_()
    return buffer


class Reduction:
    """A reduce-scatter in flight (``async_op``): this rank's rows of the mean over the ranks of
    ``buffer`` (from :func:`pack`), one gradient per parameter, each in its shard's dtype and
    shape, from :meth:`wait`. Summed, then divided by ``n``; in fp16, as PyTorch does, divided
    by a power of two before the sum and by the rest after, so that the sum does not
    overflow."""

    def __init__(self, columns: Columns, buffer: torch.Tensor, group, async_op: bool = False):
        self.columns, self.n = columns, buffer.shape[0]
        self.before = divide_before(self.n) if buffer.dtype == torch.float16 else 1
        if self.before != 1:
            buffer /= self.before
        self.mine = torch.empty(buffer.shape[1], dtype=buffer.dtype, device=buffer.device)
        self.work = ops.reduce_scatter_tensor(self.mine, buffer.view(-1), group=group,
                                              async_op=async_op)

    def wait(self) -> list[torch.Tensor]:
        if self.work is not None:
            self.work.wait()
        self.mine /= self.n / self.before
        # copies, even in the same dtype: a view would keep all of ``mine`` alive, the padded
        # chunks of every parameter of the group, as the shards' gradients (and a shard
        # shorter than its chunk gets a copy of its rows alone, not a view keeping padding)
        chunks = torch.split_with_sizes_copy(self.mine, self.columns.chunks)
        return [(c if c.numel() == p.shard.numel() else c[:p.shard.numel()].clone())
                .view(p.shard.shape).to(p.shard.dtype)
                for p, c in zip(self.columns.params, chunks)]


def reduce_scatter(columns: Columns, buffer: torch.Tensor, group) -> list[torch.Tensor]:
    """:class:`Reduction`'s gradients, at once."""
    return Reduction(columns, buffer, group).wait()


_LANDING: list[tuple[Columns, Reduction]] = []


def land_when_backward_ends(columns: Columns, reduction: Reduction) -> None:
    """Add ``reduction``'s gradients into its shards' ``.grad`` once the running backward is
    over (autograd's final callback, as PyTorch's FSDP2 waits for its reduce-scatters), so the
    reduce-scatter overlaps the backward of the modules before this one."""
    _LANDING.append((columns, reduction))
    torch.autograd.Variable._execution_engine.queue_callback(_land)


def forget_unlanded() -> None:
    """Outside any backward, drop what a backward that raised left in flight (its
    reduce-scatters are waited for, so the ranks stay in step; their gradients belong to no
    step). Inside one (a recompute under activation checkpointing) nothing is dropped."""
    if torch._C._current_graph_task_id() != -1:
        return
    while _LANDING:
        _, reduction = _LANDING.pop()
        reduction.wait()


def _land() -> None:
    while _LANDING:  # every callback queued drains them all: the later ones find none
        columns, reduction = _LANDING.pop(0)
        for p, grad in zip(columns.params, reduction.wait()):
            p.shard.grad = grad if p.shard.grad is None else p.shard.grad.add_(grad)
