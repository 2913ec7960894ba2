"""Input checks for the context-parallel attentions: one rank's shapes, then every rank's.

A receive of the wrong size completes silently with garbage on Gloo, so before the first
message the ranks compare their shapes with one small all-gather (not metered: it is not part
of the algorithm), and every rank raises the same ValueError if they differ (the engine's one
agreement check, :func:`engine.comm.checks.agree`).
"""

from __future__ import annotations

import torch

from engine.comm.checks import agree
from engine.validation import divides

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, who: str) -> None:
    """``q`` is ``(batch, heads, seq, head_dim)``; ``k`` and ``v`` ``(batch, kv_heads, seq,
    head_dim)`` with ``kv_heads`` dividing ``heads``; one floating dtype."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{who}: {name} must be a 4-d tensor (batch, heads, seq, head_dim),"
                             f" got {getattr(t, 'shape', type(t).__name__)}")
        if t.dtype not in FLOAT_DTYPES or t.dtype != q.dtype:
            raise ValueError(f"{who}: q, k and v must share one floating dtype, got "
                             f"{q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"{who}: k {tuple(k.shape)} and v {tuple(v.shape)} must have one shape")
    b, heads, s, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, s, d):
        raise ValueError(f"{who}: q {tuple(q.shape)} and k {tuple(k.shape)} must agree in "
                         "batch, sequence and head_dim")
    divides("kv_heads", k.shape[1], "heads", heads)


def check_same_on_every_rank(q: torch.Tensor, k: torch.Tensor, group, who: str) -> None:
    """Raise on every rank unless every rank holds the same q and k shapes and dtype."""
    def listing(seen):
        ranks = "; ".join(f"rank {r}: q {s[:4]}, {s[4]} kv heads, {FLOAT_DTYPES[s[5]]}"
                          for r, s in enumerate(seen))
        return (f"{who}: ranks hold different shapes ({ranks}); every rank must hold an equal "
                "share of the sequence, with the same heads and dtype")

    agree([*q.shape, k.shape[1], FLOAT_DTYPES.index(q.dtype)], group, q, listing)
