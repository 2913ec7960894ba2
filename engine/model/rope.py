"""Rotary position embeddings (RoPE): where a token is, written into its query and key.

Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding" (2021), eq. 34:
the ``d`` features of a query or key head are ``d / 2`` pairs ``(x_{2i}, x_{2i+1})``, and the
pair ``i`` of the token at position ``m`` is turned by the angle ``m * theta^(-2i/d)``:

    (x_{2i}, x_{2i+1})  ->  (x_{2i} cos a - x_{2i+1} sin a,  x_{2i} sin a + x_{2i+1} cos a)

A query at ``m`` and a key at ``n`` then meet in ``q . k`` through ``m - n`` alone: attention
sees relative positions, and no parameter holds them. Llama 3 uses ``theta = 500,000``
(Grattafiori et al., "The Llama 3 Herd of Models", 2024, section 3.2); the pairs are adjacent
features, as Meta's reference code and torchtitan pair them (as complex numbers).

Each rank rotates its tokens by their **global** positions, whatever layout it holds them in:
under context parallelism a rank's tokens are zig-zag, striped or contiguous pieces of the
sequence and it is given their positions (:mod:`engine.cp.layout`); a pipeline stage is given
the same positions as the first. So the rotated q and k are the one-process ones, and every
attention core after them (ring, Ulysses, all-gather) needs no change.
"""

from __future__ import annotations

import torch


def rotation_angles(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """``(len(positions), head_dim / 2)`` angles, ``m * theta^(-2i/d)``, in fp32."""
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    i = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
    return positions.to(torch.float32)[:, None] * theta ** (-i / head_dim)[None, :]


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """``x`` (``(batch, heads, seq, head_dim)``) with each pair of features of the token at
    ``positions[j]`` (``(seq,)``) turned by its angle (module docstring); in fp32, returned in
    ``x``'s dtype."""
    angles = rotation_angles(positions, x.shape[-1], theta)
    cos, sin = angles.cos(), angles.sin()
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    turned = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return turned.flatten(-2).to(x.dtype)
