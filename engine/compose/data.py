"""The global batch of step k, the same sequences whatever the layout, and each rank's slice.

Every rank draws the *whole* global batch of the step from the step's seed (a few thousand
token ids: cheap) and keeps its part: the batch is cut into ``m`` global micro-batches of
``B/m`` consecutive rows, and of micro-batch ``j`` the data-parallel rank ``d`` takes rows
``j B/m + [d, d+1) B/(m dp)`` (Megatron-LM's sampler: the set of sequences of global
micro-batch ``j`` is the same whatever dp, which a statistic per micro-batch, the MoE
balancing loss of :mod:`engine.compose.experts`, needs); along the sequence, the tokens of its
context-parallel index in the plan's layout (:func:`engine.cp.layout.shard_indices`), with
their positions. So one process, given the same step, sees exactly the union of what every
layout's ranks see, and the number of tokens that count in the loss is known to every rank
before the first forward (:mod:`engine.compose.loss`).

The tokens are a language a model can learn: a first-order Markov chain over the vocabulary
whose transition table is drawn once from the data seed (:func:`transition_table`; each row a
softmax of ``SHARPNESS`` x standard normal logits), sampled afresh for every step. Uniform random
tokens would leave nothing to learn (the loss would stay at ln(vocab) whatever the layout); on
the chain the loss falls from ln(vocab) towards the chain's entropy rate (the best loss any
model can reach), so a run that trains shows it.

``varlen=True``: each row packs documents of random length (2 to ``S/2 + 1`` tokens) one after
another until the next does not fit; the rest of the row is padding (id 0), and the loss
``mask`` is 0 on every target that is padding. Rows, and so micro-batches and ranks, then
hold different numbers of tokens that count: the case where a per-micro-batch mean goes
wrong. (Attention stays causal over the packed row; the mask removes padding from the loss.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.cp.layout import shard_indices

PAD = 0
SHARPNESS = 5.0  # the chain's logit scale: entropy rate about 1.1 nats at vocab 64


@dataclass(frozen=True)
class Batch:
    """Token ids, next-token targets and the loss mask (1: counts), each ``[rows, tokens]``,
    and the tokens' ``positions`` in their sequence (``[tokens]``)."""

    ids: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor

    @property
    def tokens(self) -> int:
        """How many targets count in the loss."""
        return int(self.mask.sum().item())

    def to(self, device) -> "Batch":
        return Batch(*(t.to(device) for t in (self.ids, self.targets, self.mask,
                                              self.positions)))


@functools.lru_cache(maxsize=8)
def transition_table(symbols: int, seed: int) -> torch.Tensor:
    """The chain's ``[symbols, symbols]`` transition probabilities (row a: the next token's
    distribution after a), drawn from ``seed`` alone: the same language at every step."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(SHARPNESS * torch.randn(symbols, symbols, generator=g), dim=1)


def markov_rows(rows: int, length: int, symbols: int, seed: int, g: torch.Generator
                ) -> torch.Tensor:
    """``[rows, length]`` token ids in ``[0, symbols)``: each row a walk of the chain of
    :func:`transition_table` ``(symbols, seed)`` from a uniform first token, drawn with ``g``."""
    table = transition_table(symbols, seed)
    token = torch.randint(symbols, (rows,), generator=g)
    walk = [token]
    for _ in range(length - 1):
        token = torch.multinomial(table[token], 1, generator=g).squeeze(1)
        walk.append(token)
    return torch.stack(walk, dim=1)


def packed_rows(rows: int, seq_len: int, vocab: int, g: torch.Generator, seed: int = 1
                ) -> torch.Tensor:
    """``[rows, seq_len + 1]`` streams of documents of random length, padded with ``PAD``
    (the documents' tokens: the chain over ids 1 to vocab - 1)."""
    stream = 1 + markov_rows(rows, seq_len + 1, vocab - 1, seed, g)
    for row in stream:
        used = 0
        while True:
            length = int(torch.randint(2, seq_len // 2 + 2, (1,), generator=g))
            if used + length > seq_len + 1:
                break
            used += length
        row[used:] = PAD
    return stream


def global_batch(step: int, rows: int, seq_len: int, vocab: int, seed: int = 1,
                 varlen: bool = False) -> Batch:
    """The whole global batch of ``step``: ``rows`` sequences of ``seq_len`` tokens."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if varlen:
        stream = packed_rows(rows, seq_len, vocab, g, seed)
        mask = (stream[:, 1:] != PAD).float()
    else:
        stream = markov_rows(rows, seq_len + 1, vocab, seed, g)
        mask = torch.ones(rows, seq_len)
    return Batch(stream[:, :-1].contiguous(), stream[:, 1:].contiguous(), mask,
                 torch.arange(seq_len))


def rank_slice(batch: Batch, dp: int, dp_index: int, cp: int = 1, cp_index: int = 0,
               cp_layout: str = "zigzag", micro_batches: int = 1) -> list[Batch]:
    """This rank's micro-batches of ``batch``: of each of the ``micro_batches`` global
    micro-batches its data-parallel rows (module docstring), each holding its
    context-parallel tokens in ``cp_layout``."""
    rows = batch.ids.shape[0]
    if rows % (dp * micro_batches):
        raise ValueError(f"a global batch of {rows} rows does not split into dp x "
                         f"micro_batches = {dp} x {micro_batches} equal parts")
    per = rows // (dp * micro_batches)  # rows of one rank's micro-batch
    tokens = shard_indices(batch.ids.shape[1], cp, cp_index, cp_layout)
    positions = batch.positions[tokens]
    starts = [(j * dp + dp_index) * per for j in range(micro_batches)]
    return [Batch(*(t[start:start + per][:, tokens]
                    for t in (batch.ids, batch.targets, batch.mask)), positions)
            for start in starts]
