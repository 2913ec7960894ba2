"""One parameter sharded on its first dimension, the padding kept outside the Parameter.

A parameter of ``d0`` rows over ``n`` ranks is cut in ``n`` chunks of ``ceil(d0 / n)`` rows
(``torch.chunk``'s sizes padded to equal ones, as FSDP2 does); rank ``r`` owns rows
``[r * chunk, min((r + 1) * chunk, d0))``, which may be fewer than ``chunk`` rows, or none. The
local shard, an ``nn.Parameter`` of just those rows, is what the optimizer sees: the padding
exists only in the buffers of the collectives (:meth:`DimZeroShard.padded`), never in a
parameter, a gradient or an optimizer state.

:class:`ShardedParam` is one parameter of a ``fully_shard`` call: its shard and the module
slots that hold it; :func:`shard_params` makes them for a module
(:class:`engine.fsdp.group.ShardGroup`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class DimZeroShard:
    """Where one parameter's rows live: the full shape, the chunk, this rank's rows (each
    worked out once: every collective of the group asks)."""

    shape: torch.Size  # the full parameter's
    world_size: int
    rank: int

    @functools.cached_property
    def rows(self) -> int:
        return self.shape[0]

    @functools.cached_property
    def chunk_rows(self) -> int:
        return -(-self.rows // self.world_size)  # ceil

    @functools.cached_property
    def row_numel(self) -> int:
        return self.shape[1:].numel()

    @functools.cached_property
    def chunk_numel(self) -> int:
        return self.chunk_rows * self.row_numel

    @functools.cached_property
    def padded_rows(self) -> int:
        return self.chunk_rows * self.world_size

    def local_rows(self, rank: int | None = None) -> tuple[int, int]:
        """``[start, stop)`` of the rows ``rank`` (default: this one) owns."""
        rank = self.rank if rank is None else rank
        start = min(rank * self.chunk_rows, self.rows)
        return start, min(start + self.chunk_rows, self.rows)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``full``, a copy."""
        start, stop = self.local_rows()
        return full[start:stop].clone()

    def padded(self, local: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``local`` flattened into a ``chunk_numel`` buffer, zeros after its rows."""
        out = torch.zeros(self.chunk_numel, dtype=dtype or local.dtype, device=local.device)
        out[:local.numel()] = local.reshape(-1)
        return out

    def unpad(self, gathered: torch.Tensor) -> torch.Tensor:
        """The full parameter from the ``padded_rows`` rows of the ranks' chunks in order."""
        return gathered.reshape(self.padded_rows, *self.shape[1:])[:self.rows]

    def scatter_rows(self, full: torch.Tensor, chunks: torch.Tensor, add: bool = False) -> None:
        """Write (``add``: add) the whole ``full`` into ``chunks``, ``n x chunk_numel`` (rank r's
        chunk in row r, a column slice of a collective's buffer): the padded layout of
        :meth:`padded` for every rank at once, without a padded copy."""
        flat, c = full.reshape(-1), self.chunk_numel
        k, rest = divmod(flat.numel(), c)  # k ranks hold a whole chunk, one holds ``rest``
        write = (lambda dst, src: dst.add_(src)) if add else (lambda dst, src: dst.copy_(src))
        write(chunks[:k], flat[:k * c].view(k, c))
        if rest:
            write(chunks[k, :rest], flat[k * c:])
        if not add:  # the padding: zeros
            if rest:
                chunks[k, rest:].zero_()
            chunks[k + bool(rest):].zero_()

    def gather_rows(self, chunks: torch.Tensor, out: torch.Tensor) -> None:
        """The inverse of :meth:`scatter_rows`: the whole parameter from ``chunks`` into
        ``out`` (its shape), the padding left out."""
        flat, c = out.view(-1), self.chunk_numel
        k, rest = divmod(flat.numel(), c)
        flat[:k * c].view(k, c).copy_(chunks[:k])
        if rest:
            flat[k * c:].copy_(chunks[k, :rest])


class ShardedParam:
    """A parameter's local shard, its layout, and the (module, name) slots that hold it
    (more than one for a tied parameter)."""

    def __init__(self, param: nn.Parameter, slots: list[tuple[nn.Module, str]],
                 world_size: int, rank: int):
        self.layout = DimZeroShard(param.shape, world_size, rank)
        self.shard = nn.Parameter(self.layout.take(param.detach()),
                                  requires_grad=param.requires_grad)
        self.shard.fsdp_layout = self.layout  # full_state_dict finds its shards by it
        self.slots = slots
        self.point_at(self.shard)

    def point_at(self, tensor: torch.Tensor) -> None:
        """Every slot of the parameter holds ``tensor`` (its shard, or it whole)."""
        for module, name in self.slots:
            module._parameters[name] = tensor


def shard_params(module: nn.Module, world_size: int, rank: int,
                 ignored: frozenset = frozenset()) -> list[ShardedParam]:
    """Every parameter of ``module`` and its children not sharded yet (a child's
    ``fully_shard`` took its own) nor ``ignored`` (ids), sharded; each once, however many
    slots hold it."""
    slots: dict[int, tuple[nn.Parameter, list]] = {}
    for owner in module.modules():
        for name, p in owner._parameters.items():
            if p is not None and not hasattr(p, "fsdp_layout") and id(p) not in ignored:
                slots.setdefault(id(p), (p, []))[1].append((owner, name))
    return [ShardedParam(p, where, world_size, rank) for p, where in slots.values()]
