"""Attention on one block of queries against one block of keys, and the online-softmax merge.

Softmax attention over a whole row of keys can be computed block by block (Milakov &
Gimelshein, "Online normalizer calculation for softmax", 2018; Dao et al., FlashAttention,
2022, section 3.1). For a block of keys, keep the block's normalised output ``O_j`` and the
log-sum-exp of its scores ``L_j = log sum_k exp(s_k)``. Two blocks merge exactly:

    L = log(exp(L_1) + exp(L_2))                       (torch.logaddexp)
    O = exp(L_1 - L) O_1 + exp(L_2 - L) O_2

since each ``O_j`` is its block's ``sum_k exp(s_k - L_j) v_k``. Ring attention merges the
blocks as they arrive round the ring; nothing of size ``S x S`` is ever held.

Backward needs only ``L`` and ``D = rowsum(dO * O)`` per query (FlashAttention-2, Dao 2023,
Algorithm 2): with ``P = exp(S - L)``, ``dV = P^T dO``, ``dS = P * (dO V^T - D)``,
``dQ = dS K * scale``, ``dK = dS^T Q * scale``; the block's ``P`` is recomputed, not stored.

Grouped-query attention (Ainslie et al., "GQA", 2023): ``heads`` query heads share
``kv_heads`` key/value heads, query head ``i`` reading kv head ``i // (heads / kv_heads)``. The
blocks expand K and V here, and fold dK and dV back, so only ``kv_heads`` travel.

The arithmetic runs in :func:`accumulation_dtype`: the wider of the input dtype and fp32 (fp16
and bf16 inputs accumulate in fp32, as FlashAttention does; fp64 stays fp64, so the blocks
agree with fp64 ``scaled_dot_product_attention`` to rounding). A block on the causal diagonal
is masked by :func:`engine.model.attention.causal_mask`, as the dense GPT's attention is: this is the
same attention (Vaswani et al. 2017, eq. 1), computed block by block. The striped layout
(Brandon et al. 2023) adds a third kind, ``BELOW``: query ``i`` sees keys ``0 .. i-1`` of the
block (strictly below the diagonal), so its first row sees no key at all; that row's ``lse`` is
``-inf`` and its output 0, which the merge then weighs by ``exp(-inf) = 0``.
"""

from __future__ import annotations

import torch

from engine.model.attention import causal_mask

FULL, DIAGONAL = "full", "diagonal"  # a block entirely visible, or on the causal diagonal
BELOW = "below"  # strictly below the diagonal: query i sees keys 0 .. i-1 (striped layout)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the blocks compute and accumulate in: the wider of ``dtype`` and fp32."""
    return torch.promote_types(dtype, torch.float32)


def expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``(b, kv_heads, s, d)`` -> ``(b, heads, s, d)``: each kv head repeated for its group."""
    return t.repeat_interleave(heads // t.shape[1], dim=1) if t.shape[1] != heads else t


def fold_kv(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The transpose of :func:`expand_kv`: sum the gradients of each group of query heads."""
    b, heads, s, d = t.shape
    return t.view(b, kv_heads, heads // kv_heads, s, d).sum(2) if heads != kv_heads else t


def _scores(q, k, scale, kind):
    scores = q @ expand_kv(k, q.shape[1]).transpose(-2, -1) * scale
    if kind == DIAGONAL:  # query i sees keys 0..i of the same chunk
        scores = causal_mask(scores)
    elif kind == BELOW:  # query i sees keys 0..i-1
        seen = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril(-1)
        scores = scores.masked_fill(~seen, float("-inf"))
    return scores


def _finite(lse):
    """``lse`` with the rows that saw no key (``-inf``) set to 0, to subtract safely."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def block_forward(q, k, v, scale: float, kind: str = FULL):
    """``(out, lse)`` of queries ``q`` against one block of keys/values, in their dtype (the
    callers pass :func:`accumulation_dtype`). A row that sees no key gets ``lse = -inf`` and
    output 0."""
    scores = _scores(q, k, scale, kind)
    lse = scores.logsumexp(dim=-1)
    out = torch.exp(scores - _finite(lse).unsqueeze(-1)) @ expand_kv(v, q.shape[1])
    return out, lse


def merge(out, lse, block_out, block_lse):
    """The online-softmax merge of a running ``(out, lse)`` with a new block's: exact.

    Start from ``out = 0`` and ``lse = -inf`` (no keys seen yet): the first merge returns the
    block itself. Every block merged must have seen at least one key in each row."""
    new_lse = torch.logaddexp(lse, block_lse)
    out = (out * torch.exp(lse - new_lse).unsqueeze(-1)
           + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1))
    return out, new_lse


def block_backward(q, k, v, lse, dout, delta, scale: float, kind: str = FULL):
    """``(dq, dk, dv)`` of one block, from the final ``lse`` and ``delta = rowsum(dO * O)``."""
    p = torch.exp(_scores(q, k, scale, kind) - _finite(lse).unsqueeze(-1))
    kv_heads = k.shape[1]
    dv = fold_kv(p.transpose(-2, -1) @ dout, kv_heads)
    ds = p * (dout @ expand_kv(v, q.shape[1]).transpose(-2, -1) - delta.unsqueeze(-1))
    dq = ds @ expand_kv(k, q.shape[1]) * scale
    dk = fold_kv(ds.transpose(-2, -1) @ q, kv_heads) * scale
    return dq, dk, dv
