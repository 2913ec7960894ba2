"""One parameter sharded on its first dimension, the padding kept outside the Parameter.

A parameter of ``d0`` rows over ``n`` ranks is cut in ``n`` chunks of ``ceil(d0 / n)`` rows
(``torch.chunk``'s sizes padded to equal ones, as FSDP2 does); rank ``r`` owns rows
``[r * chunk, min((r + 1) * chunk, d0))``, which may be fewer than ``chunk`` rows, or none. The
local shard, an ``nn.Parameter`` of just those rows, is what the optimizer sees: the padding
exists only in the buffers of the collectives (:meth:`DimZeroShard.padded`), never in a
parameter, a gradient or an optimizer state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DimZeroShard:
    """Where one parameter's rows live: the full shape, the chunk, this rank's rows."""

    shape: torch.Size  # the full parameter's
    world_size: int
    rank: int

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def chunk_rows(self) -> int:
        return -(-self.rows // self.world_size)  # ceil

    @property
    def row_numel(self) -> int:
        return self.shape[1:].numel()

    @property
    def chunk_numel(self) -> int:
        return self.chunk_rows * self.row_numel

    @property
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
