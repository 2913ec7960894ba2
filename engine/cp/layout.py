"""Which tokens each rank holds under context parallelism: contiguous, zig-zag and striped.

The sequence of ``S`` tokens is cut into equal *chunks*. Each rank of an ``N``-rank group holds:

* ``"contiguous"``: ``N`` chunks of ``S/N`` tokens, rank ``r`` chunk ``r`` (Liu et al., "Ring
  attention with blockwise transformers for near-infinite context", 2023). Under a causal mask
  rank 0's queries see only its own keys while rank ``N-1``'s see every key: the last rank
  does about twice the average work.
* ``"zigzag"``: ``2N`` chunks of ``S/(2N)`` tokens, rank ``r`` chunks ``r`` and ``2N-1-r``: one
  early and one late chunk each, so every rank does the same causal work (the "head-tail"
  placement Megatron-Core's context parallelism and PyTorch's ``context_parallel`` use).
* ``"striped"``: token ``t`` on rank ``t mod N`` (Brandon et al., "Striped attention: faster
  ring attention for causal transformers", 2023): a different permutation. Every block a rank
  computes is then a triangle (its own and earlier ranks' blocks including the diagonal, later
  ranks' strictly below it), so every ring step does about half a block on every rank.

Pure functions, no communication: call :func:`check_sequence_split` before any rank starts.
:func:`shard_sequence` takes a rank's part of a whole tensor; :func:`gather_sequence` puts the
parts back in order with one all-gather (through :mod:`engine.comm.ops`, so it is metered).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.comm import ops
from engine.validation import one_of, positive_int

LAYOUTS = ("zigzag", "contiguous", "striped")


def chunks_per_rank(layout: str) -> int:
    """Chunks a rank holds: 2 (zig-zag) or 1 (contiguous; striped counts its interleaved
    tokens as one chunk)."""
    return 2 if one_of("layout", layout, LAYOUTS) == "zigzag" else 1


def check_sequence_split(seq_len: int, n: int, layout: str) -> int:
    """The chunk length, or a ValueError saying why ``seq_len`` tokens do not split ``n`` ways
    under ``layout`` (zig-zag needs ``2n`` equal chunks, contiguous ``n``)."""
    positive_int("seq_len", seq_len)
    positive_int("n", n)
    pieces = n * chunks_per_rank(layout)
    if seq_len % pieces:
        need = f"2 x {n} = {pieces}" if layout == "zigzag" else f"{n}"
        raise ValueError(f"sequence length {seq_len} does not split into the {need} equal "
                         f"chunks the {layout} layout needs on {n} ranks "
                         f"({seq_len} % {pieces} = {seq_len % pieces})")
    return seq_len // pieces


def rank_chunks(rank: int, n: int, layout: str) -> list[int]:
    """The chunk indices ``rank`` holds, in the order its tokens are stored (striped: its one
    interleaved chunk, ``[rank]``)."""
    if layout == "zigzag":
        return [rank, 2 * n - 1 - rank]
    one_of("layout", layout, LAYOUTS)
    return [rank]


def shard_indices(seq_len: int, n: int, rank: int, layout: str) -> torch.Tensor:
    """Positions (0 .. seq_len-1) of the tokens ``rank`` holds, in its storage order."""
    c = check_sequence_split(seq_len, n, layout)
    if layout == "striped":
        return torch.arange(rank, seq_len, n)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in rank_chunks(rank, n, layout)])


def _group_rank_and_size(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def shard_sequence(x: torch.Tensor, group=None, layout: str = "zigzag", dim: int = -2
                   ) -> torch.Tensor:
    """This rank's part of ``x`` (whole on every rank) along ``dim`` (default -2: the sequence
    of a ``(batch, heads, seq, head_dim)`` tensor). No communication."""
    rank, n = _group_rank_and_size(group)
    index = shard_indices(x.shape[dim], n, rank, layout).to(x.device)
    return x.index_select(dim, index)


def gather_sequence(x: torch.Tensor, group=None, layout: str = "zigzag", dim: int = -2
                    ) -> torch.Tensor:
    """The whole sequence, in natural order, on every rank, from each rank's part ``x``: one
    all-gather, then the chunks put back in place. Not differentiable (for checking)."""
    rank, n = _group_rank_and_size(group)
    local = x.detach().movedim(dim, 0).contiguous()
    everyone = torch.empty((n, *local.shape), dtype=x.dtype, device=x.device)
    if n == 1:
        everyone[0].copy_(local)
    else:
        ops.all_gather_into_tensor(everyone.view(-1), local.view(-1), group=group)
    seq_len = n * local.shape[0]
    order = torch.cat([shard_indices(seq_len, n, r, layout) for r in range(n)])
    whole = torch.empty((seq_len, *local.shape[1:]), dtype=x.dtype, device=x.device)
    whole[order.to(x.device)] = everyone.flatten(0, 1)
    return whole.movedim(0, dim)
