"""Where tensor parallelism cuts each parameter of the GPT: the one table that the composed
engine (its cut, :func:`engine.compose.parallelize.apply_tensor_parallel` through
:func:`heads_slice`, and its join, :func:`engine.compose.state.join_tp`) and the offline re-cut
(:mod:`engine.compose.reshard`) all read.

Megatron-LM (Shoeybi et al. 2019, section 3) splits a column-parallel linear layer's weight
and bias on their output dimension (dim 0: ``fc``; ``qkv`` by heads; SwiGLU's fused ``gate_up`` by halves, :data:`HALVES`), a row-parallel one's
weight on its input dimension (dim 1: ``out``, ``proj``; the bias is added once, after the
all-reduce, so every rank holds all of it) and the vocab-parallel embedding and output layer on
the vocabulary (dim 0: ``tok``, and ``head`` when it is not tied to ``tok``). The attention's
fused ``[q | k | v]`` is cut by heads (:data:`HEADS`): rank ``r`` holds its query heads, its
key heads and its value heads side by side, so its slice is not one contiguous piece of the
dense tensor; under grouped-query attention (Ainslie et al. 2023) q has more rows than k and v
(:func:`qkv_sizes`). Everything else (LayerNorms, the position embedding, the row-parallel
biases, the experts of an MoE layer) is replicated: every rank holds the whole tensor.

Names are the dense :class:`engine.model.gpt.GPT`'s. Pure: no communication.
"""

from __future__ import annotations

import re

import torch

HEADS = "heads"  # rank r holds [q_r k_r v_r]: its heads of q, of k and of v, side by side
HALVES = "halves"  # SwiGLU's [gate | up]: rank r holds [gate_r up_r]

# The dimension each split parameter is cut on (a block's parameters by their name inside the
# block); a name not here is replicated.
TP_SPLIT: dict[str, int | str] = {
    "tok.weight": 0, "head.weight": 0,  # vocab-parallel embedding and (untied) output layer
    "attn.qkv.weight": HEADS, "attn.qkv.bias": HEADS,  # column-parallel, by heads
    "attn.proj.weight": 1,  # row-parallel
    "fc.weight": 0, "fc.bias": 0,  # column-parallel
    "gate_up.weight": HALVES, "gate_up.bias": HALVES,  # column-parallel, each half cut
    "out.weight": 1,  # row-parallel
}

_IN_BLOCK = re.compile(r"blocks\.\d+\.(.*)")


def split_dim(name: str) -> int | str | None:
    """The dimension tensor parallelism cuts the dense parameter ``name`` on (``"blocks.3.fc.
    weight"`` or ``"fc.weight"``): an int, :data:`HEADS`, :data:`HALVES`, or ``None`` if
    replicated."""
    match = _IN_BLOCK.fullmatch(name)
    return TP_SPLIT.get(match.group(1) if match else name)


def qkv_sizes(heads: int, kv_heads: int, head_dim: int) -> list[int]:
    """The rows of q, of k and of v in a dense fused ``[q | k | v]`` weight (grouped-query
    attention: ``kv_heads < heads``)."""
    return [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]


def halves(rows: int) -> list[int]:
    """The rows of SwiGLU's gate and up projection in a dense fused ``[gate | up]``."""
    return [rows // 2] * 2


def thirds(rows: int) -> list[int]:
    """:func:`qkv_sizes` of multi-head attention, from the fused tensor's rows alone."""
    return [rows // 3] * 3


def heads_slice(whole: torch.Tensor, t: int, rank: int, sizes: list[int] | None = None
                ) -> torch.Tensor:
    """Rank ``rank``'s slice of a dense fused ``qkv`` weight or bias ``[q | k | v]`` (dim 0)
    over ``t`` ranks: its heads of q, of k and of v, side by side. ``sizes``: the rows of q, k
    and v (:func:`qkv_sizes`; default: three equal parts, multi-head attention)."""
    sizes = sizes or thirds(whole.shape[0])
    return torch.cat([part.chunk(t, dim=0)[rank] for part in whole.split(sizes, dim=0)])


def heads_joined(slices: list[torch.Tensor], sizes: list[int] | None = None) -> torch.Tensor:
    """The inverse of :func:`heads_slice`: ``[q_r k_r v_r]`` per rank, in rank order, ->
    ``[q_0 q_1 .. | k_0 k_1 .. | v_0 v_1 ..]``. ``sizes``: the dense rows of q, k and v."""
    t = len(slices)
    sizes = sizes or thirds(sum(s.shape[0] for s in slices))
    parts = [s.split([n // t for n in sizes], dim=0) for s in slices]  # per rank: q, k, v
    return torch.cat([torch.cat([p[j] for p in parts]) for j in range(len(sizes))])


def join(name: str, slices: list[torch.Tensor], sizes: list[int] | None = None
         ) -> torch.Tensor:
    """The dense parameter ``name`` from its tensor-parallel slices, in rank order (``sizes``:
    the fused qkv's rows of q, k and v, see :func:`heads_joined`)."""
    if len(slices) == 1:
        return slices[0]
    split = split_dim(name)
    if split is None:  # replicated: every tp rank holds the same tensor
        return slices[0]
    if split == HEADS:
        return heads_joined(slices, sizes)
    if split == HALVES:
        return heads_joined(slices, halves(sum(s.shape[0] for s in slices)))
    return torch.cat(slices, dim=split)
