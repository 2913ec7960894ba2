"""All-to-all from point-to-point sends: every rank sends a different piece to every other.

Rank i's input is cut along dim 0 into N pieces; piece j goes to rank j, and rank i's output is
the pieces addressed to it, in rank order (``torch.distributed.all_to_all_single``'s contract,
uneven splits included). It is the collective of expert parallelism (tokens dispatched to the
rank holding their expert and combined back; Lepikhin et al., GShard, 2020) and of Ulysses
sequence parallelism (sequence-sharded to head-sharded and back; Jacobs et al., 2023).

Pairwise exchange: in step s = 1 .. N-1, rank i sends to i+s and receives from i-s, both at
once; the piece a rank keeps is copied locally. Each rank sends its input less its own piece,
(N-1)/N·S for even splits of S bytes (``theory.all_to_all_bytes``), and every link carries
one piece per step, so no rank waits on a busy neighbour.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.comm import p2p
from engine.comm.checks import SUPPORTED_DTYPES, gather_ints
from engine.comm.ring import exchange


def even_splits(rows: int, n: int, what: str) -> list[int]:
    """``rows`` cut into ``n`` equal pieces, or a ValueError saying why it cannot be."""
    if rows % n:
        raise ValueError(f"{what} has {rows} rows along dim 0, which {n} ranks cannot split "
                         "evenly; pass split sizes")
    return [rows // n] * n


def check_splits(output, input, output_splits, input_splits, group) -> None:
    """Raise on every rank unless rank i sends rank j exactly what j expects from i (one small
    uncounted all-gather, :func:`engine.comm.checks.gather_ints`)."""
    n = dist.get_world_size(group)
    for name, t, splits in (("input", input, input_splits), ("output", output, output_splits)):
        if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != t.shape[0]:
            raise ValueError(f"{name}_split_sizes {list(splits)} must be {n} sizes >= 0 adding "
                             f"up to the {name}'s {t.shape[0]} rows")
    if input.dtype != output.dtype or input.shape[1:] != output.shape[1:]:
        raise ValueError(f"input {input.dtype} {tuple(input.shape)} and output {output.dtype} "
                         f"{tuple(output.shape)} must agree in dtype and in every dim but 0")
    row = input[0].numel() if input.dim() > 1 else 1
    dtype = SUPPORTED_DTYPES.index(input.dtype) if input.dtype in SUPPORTED_DTYPES else -1
    table = torch.tensor(gather_ints([*input_splits, *output_splits, row, dtype], group, input))
    sends, expects = table[:, :n], table[:, n:2 * n]
    if (sends != expects.T).any() or len({tuple(r) for r in table[:, 2 * n:].tolist()}) > 1:
        raise ValueError("ranks disagree on the all-to-all: rank i's input_split_sizes[j] must "
                         f"equal rank j's output_split_sizes[i]; sends {sends.tolist()}, "
                         f"expected {expects.T.tolist()} (and every rank the same row size "
                         "and dtype)")


def pairwise_all_to_all(output: torch.Tensor, input: torch.Tensor,
                        output_split_sizes: list[int] | None = None,
                        input_split_sizes: list[int] | None = None, group=None,
                        check: bool = True) -> torch.Tensor:
    """Fill ``output`` with the pieces of every rank's ``input`` addressed to this rank.

    Split sizes count rows along dim 0 (``None``: equal pieces). ``check`` first verifies, with
    one small uncounted all-gather, that every rank agrees on the sizes (a receive of the wrong
    size otherwise completes silently with garbage). Returns ``output``.
    """
    ranks = p2p.group_ranks(group)
    n, me = len(ranks), ranks.index(dist.get_rank())
    input_splits = list(input_split_sizes or even_splits(input.shape[0], n, "input"))
    output_splits = list(output_split_sizes or even_splits(output.shape[0], n, "output"))
    if not (input.is_contiguous() and output.is_contiguous()):
        raise ValueError("all-to-all needs contiguous input and output; call .contiguous()")
    if check:
        check_splits(output, input, output_splits, input_splits, group)
    pieces_in = input.split(input_splits)
    pieces_out = output.split(output_splits)
    pieces_out[me].copy_(pieces_in[me])
    for step in range(1, n):
        dst, src = (me + step) % n, (me - step) % n
        exchange(pieces_in[dst], ranks[dst], pieces_out[src], ranks[src], group)
    return output
