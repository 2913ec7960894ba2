"""Every synthetic dataset of the course, in one module.

* **Regression** for the small MLPs: :func:`regression_data` (a noisy linear map),
  :func:`noise_regression_data` (inputs against small pure-noise targets: gradients small
  enough to underflow in fp16, chapter 12), :func:`teacher_data` (a fixed random tanh
  teacher, learnable); :func:`teacher_classes` (classes labelled by a random MLP, chapter
  03); :func:`shard`, a rank's contiguous slice of a batch.
* **Tokens**: :func:`token_data` (uniform random ids: nothing to learn, the shapes only), and
  the language every GPT run trains on, a first-order Markov chain over the vocabulary
  (:func:`transition_table`, :func:`markov_rows`), as :func:`markov_tokens` pairs or as the
  composed engine's :func:`global_batch` of each step.

The global batch of step k is the same sequences whatever the layout: every rank draws the
*whole* batch of the step from the step's seed (a few thousand token ids: cheap) and keeps its
part (:func:`engine.compose.data.rank_slice`). So one process, given the same step, sees
exactly the union of what every layout's ranks see, and the number of tokens that count in the
loss is known to every rank before the first forward (:mod:`engine.compose.loss`).

The chain's transition table is drawn once from the data seed (each row a softmax of
``SHARPNESS`` x standard normal logits) and sampled afresh for every step. Uniform random
tokens would leave nothing to learn (the loss would stay at ln(vocab) whatever the layout); on
the chain the loss falls from ln(vocab) towards the chain's entropy rate (the best loss any
model can reach), so a run that trains shows it. A vocabulary of more than
``DENSE_SYMBOLS`` tokens (GPT-2's 50,257; Llama 3's 128,256) would make that table tens of
gigabytes, so there each token's next is drawn among ``SUCCESSORS`` tokens of its own
(:func:`successor_table`, a few tens of megabytes): the same kind of chain, sparse.

``varlen=True``: each row packs documents of random length (2 to ``S/2 + 1`` tokens) one after
another until the next does not fit; the rest of the row is padding (id 0), and the loss
``mask`` is 0 on every target that is padding. Rows, and so micro-batches and ranks, then
hold different numbers of tokens that count: the case where a per-micro-batch mean goes
wrong. (Attention stays causal over the packed row; the mask removes padding from the loss.)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from engine.model.mlp import MLP
from engine.model.seed import seeded


def regression_data(
    n: int, d_in: int, d_out: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples of a fixed random linear map plus noise: ``(x [n, d_in], y [n, d_out])``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, d_out, generator=g) / math.sqrt(d_in)
    y = x @ w + 0.01 * torch.randn(n, d_out, generator=g)
    return x, y


def teacher_classes(samples: int, seed: int, teacher: tuple[int, ...] = (32, 64, 10)):
    """``samples`` Gaussian inputs labelled by a fixed random MLP ``teacher`` (the same for
    every seed: its weights are drawn from seed 1234) with its argmax class: a task a student
    MLP really learns (chapter 03's convergence experiment)."""
    net = MLP(teacher, seed=1234)
    with seeded(seed), torch.no_grad():
        x = torch.randn(samples, teacher[0])
        return x, net(x).argmax(dim=1)


def token_data(
    batch: int, seq_len: int, vocab: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and their next-token targets: ``(idx, targets)``, each ``[batch, seq]``."""
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(vocab, (batch, seq_len + 1), generator=g)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def shard(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous slice of a global batch (data parallelism splits it this way)."""
    if batch.size(0) % world_size:
        raise ValueError(
            f"global batch of {batch.size(0)} does not split evenly over {world_size} ranks"
        )
    per = batch.size(0) // world_size
    return batch[rank * per : (rank + 1) * per]


def noise_regression_data(rows: int = 1024, width: int = 64, seed: int = 1):
    """``rows`` standard normal inputs against targets of pure noise with std 0.1, both
    ``[rows, width]``: a loss whose gradients are small enough to underflow in fp16."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=generator)
    return x, 0.1 * torch.randn(rows, width, generator=generator)


def teacher_data(rows: int = 256, width: int = 32, seed: int = 1):
    """Inputs and a learnable target: ``tanh(x P)`` for a fixed random ``P`` (std 1/sqrt(w))."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=generator)
    teacher = torch.randn(width, width, generator=generator) / width**0.5
    return x, torch.tanh(x @ teacher)


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


DENSE_SYMBOLS = 1024  # up to here the table is [symbols, symbols] (4 MB at 1,024)
SUCCESSORS = 32  # beyond it: each token's next among 32 of its own


@functools.lru_cache(maxsize=4)
def successor_table(symbols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A large vocabulary's chain: ``(ids, probs)``, each ``[symbols, SUCCESSORS]``; after
    token a the next is ``ids[a, j]`` with probability ``probs[a, j]``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(symbols, (symbols, SUCCESSORS), generator=g)
    probs = torch.softmax(SHARPNESS * torch.randn(symbols, SUCCESSORS, generator=g), dim=1)
    return ids, probs


@functools.lru_cache(maxsize=8)
def transition_table(symbols: int, seed: int) -> torch.Tensor:
    """The chain's ``[symbols, symbols]`` transition probabilities (row a: the next token's
    distribution after a), drawn from ``seed`` alone: the same language at every step."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(SHARPNESS * torch.randn(symbols, symbols, generator=g), dim=1)


def markov_rows(rows: int, length: int, symbols: int, seed: int, g: torch.Generator
                ) -> torch.Tensor:
    """``[rows, length]`` token ids in ``[0, symbols)``: each row a walk of the chain of
    :func:`transition_table` ``(symbols, seed)`` from a uniform first token, drawn with ``g``
    (more than ``DENSE_SYMBOLS`` symbols: of :func:`successor_table`)."""
    token = torch.randint(symbols, (rows,), generator=g)
    walk = [token]
    if symbols > DENSE_SYMBOLS:
        ids, probs = successor_table(symbols, seed)
        for _ in range(length - 1):
            pick = torch.multinomial(probs[token], 1, generator=g)
            token = ids[token].gather(1, pick).squeeze(1)
            walk.append(token)
        return torch.stack(walk, dim=1)
    table = transition_table(symbols, seed)
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


def markov_tokens(batch: int, seq_len: int, vocab: int, seed: int, chain_seed: int = 0):
    """``batch`` walks of the chain of :func:`transition_table` ``(vocab, chain_seed)``, drawn
    from ``seed``, as ``(idx, targets)``, each ``[batch, seq_len]``."""
    stream = markov_rows(batch, seq_len + 1, vocab, chain_seed,
                         torch.Generator().manual_seed(seed))
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()
