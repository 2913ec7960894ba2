"""Synthetic data for the small models: a noisy linear map, random tokens, and a rank's slice.

The composed engine's batches (a Markov chain a GPT can learn, packed documents, each rank's
slice of the step's global batch) are :mod:`engine.compose.data`.
"""

from __future__ import annotations

import math

import torch


def regression_data(
    n: int, d_in: int, d_out: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples of a fixed random linear map plus noise: ``(x [n, d_in], y [n, d_out])``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, d_out, generator=g) / math.sqrt(d_in)
    y = x @ w + 0.01 * torch.randn(n, d_out, generator=g)
    return x, y


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
