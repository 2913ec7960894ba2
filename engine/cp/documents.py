"""Packed documents under context parallelism: the causal mask cut into documents, and how
evenly each layout spreads the work that is left.

Pretraining packs several documents into one sequence and masks attention between them: a
token sees the earlier tokens of **its own document** only (a block-diagonal causal mask;
Llama 3, Dubey et al. 2024, section 3.2, and section 3.3.2 for long-context training, where
this mask is one reason Llama 3 chose all-gather context parallelism: any mask is then a
local computation on the whole K/V). A FlashAttention-style kernel skips the masked pairs
(its variable-length "varlen" form takes the documents' start offsets, ``cu_seqlens``), so a
query at position ``p`` of a document starting at ``s`` costs ``p - s + 1`` score pairs.

The zig-zag layout (:mod:`engine.cp.layout`) balances the plain causal mask, whose work grows
linearly with ``p``; under a document mask the work of a query depends on where its document
started, and the balance is gone: with many short documents every query costs about the same
and the contiguous layout is already balanced, with one document zig-zag is right, with a mix
neither is (striped, token t on rank t mod N, stays near balance while the documents are
much longer than N). The fix used with packed documents is to zig-zag **each document**:
``layout="per-document"`` cuts every document into 2N chunks, as Transformer Engine's packed
("THD") format does for context parallelism, which is why it asks every document's length to
divide by 2N. :func:`rank_document_pairs` counts each rank's unmasked (query, key) pairs for its
queries (the work it does, whichever way K/V reach it), :func:`document_mask` builds the mask
itself for a brute-force check.
"""

from __future__ import annotations

import torch

from engine.cp.layout import shard_indices
from engine.validation import positive_int


def check_documents(lengths) -> list[int]:
    """The document lengths as ints, or a ValueError naming the bad one."""
    lengths = [int(x) for x in lengths]
    if not lengths or any(x < 1 for x in lengths):
        raise ValueError(f"document lengths must be positive token counts, got {lengths}")
    return lengths


def document_starts(lengths) -> torch.Tensor:
    """[S]: the position at which each token's document starts."""
    lengths = check_documents(lengths)
    offsets = torch.tensor([0] + lengths[:-1]).cumsum(0)
    return offsets.repeat_interleave(torch.tensor(lengths))


def document_mask(lengths) -> torch.Tensor:
    """[S, S] bool: query ``i`` may see key ``j`` (``j <= i``, same document)."""
    starts = document_starts(lengths)
    pos = torch.arange(len(starts))
    return (pos[None, :] <= pos[:, None]) & (starts[None, :] == starts[:, None])


def rank_document_pairs(lengths, n: int, layout: str) -> list[int]:
    """Unmasked score pairs of each rank's queries under the document mask of ``lengths``
    (``sum(lengths)`` tokens split over ``n`` ranks by ``layout``): ``sum p - start(p) + 1``.
    ``layout="per-document"``: every document cut in ``2n`` chunks and zig-zagged on its own
    (each length must divide by ``2n``)."""
    positive_int("n", n)
    lengths = check_documents(lengths)
    if layout == "per-document":
        return [sum(int(shard_indices(length, n, rank, "zigzag").sum()) + length // n
                    for length in lengths) for rank in range(n)]
    starts = document_starts(lengths)
    cost = torch.arange(len(starts)) - starts + 1
    return [int(cost[shard_indices(len(starts), n, rank, layout)].sum()) for rank in range(n)]


LAYOUTS = ("contiguous", "zigzag", "striped", "per-document")


def document_imbalance(lengths, n: int, layouts=LAYOUTS) -> dict[str, float]:
    """``{layout: busiest rank's pairs / mean}`` (1 is perfect balance)."""
    out = {}
    for layout in layouts:
        pairs = rank_document_pairs(lengths, n, layout)
        out[layout] = max(pairs) / (sum(pairs) / n)
    return out
