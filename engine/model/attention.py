"""Causal scaled dot-product attention: the one kernel the dense, tensor- and context-parallel
GPTs share.

Vaswani et al., "Attention Is All You Need" (NeurIPS 2017), eq. 1:

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V

made causal (GPT, Radford et al. 2018; section 3.2.3 of the same paper): query ``i`` sees keys
``0 .. i`` only, the later scores set to ``-inf`` before the softmax (:func:`causal_mask`).

:func:`causal_attention` is written out rather than calling ``F.scaled_dot_product_attention``
so it reads as the equation and gives the same bits on every backend: the dense
:class:`engine.model.gpt.TinyGPT` and its tensor-parallel split
(:func:`engine.compose.parallelize.apply_tensor_parallel`, ``heads / t`` heads per rank) are
compared to each other bit for bit. Context parallelism computes the
same attention block by block (:mod:`engine.cp.blocks`) and masks its diagonal blocks with
:func:`causal_mask`.

:func:`fast_causal_attention` is the fast path beside it: PyTorch's fused
``F.scaled_dot_product_attention`` (FlashAttention, Dao et al. 2022, on GPUs that have it; a
fused kernel on CPUs), the same equation without the ``s x s`` scores held for backward. It is
what ``GPTConfig(attention="fast")`` and the GPU lab run; equal to the written-out kernel within
fp32 rounding (a different order of the sums: tests/test_presets.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def causal_mask(scores: torch.Tensor) -> torch.Tensor:
    """``scores`` (``(..., s, s)``: query ``i``, key ``j``) with every key after its query set
    to ``-inf``, so that softmax gives it no weight."""
    s = scores.shape[-1]
    visible = torch.ones(s, s, dtype=torch.bool, device=scores.device).tril()
    return scores.masked_fill(~visible, float("-inf"))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``softmax(mask(q k^T / sqrt(d))) v`` for ``q, k, v`` of shape ``(batch, heads, seq,
    d)``; returns ``(batch, heads, seq, d)``."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return causal_mask(scores).softmax(dim=-1) @ v


def fast_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """:func:`causal_attention` by PyTorch's fused kernel; ``k`` and ``v`` may have fewer
    heads than ``q`` (grouped-query attention: each serves ``heads / kv_heads`` query heads).

    On the meta device (a dry run, :mod:`engine.train.dry_run`) PyTorch would fall back to
    the written-out math and keep every ``s x s`` score for backward; there the CPU's flash
    kernel itself runs, as it does on a CPU, which keeps what a GPU's flash attention keeps:
    q, k, v (grouped-query heads not repeated), the output and one log-sum-exp per query."""
    if q.is_meta:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, is_causal=True)[0]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                          enable_gqa=k.shape[1] != q.shape[1])
