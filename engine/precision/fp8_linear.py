"""FP8 linear layers, emulated, and a small language model trained with them against bf16.

The hybrid recipe of FP8 training (Micikevicius et al., "FP8 Formats for Deep Learning", 2022;
Transformer Engine's ``Format.HYBRID``): the three matmuls of a linear layer run in FP8 with
fp32 accumulation, the forward operands in E4M3 and the output gradient in E5M2 (its wider
range), the weights kept in fp32 (the optimizer never sees FP8). DeepSeek-V3 (section 3.3)
differs: E4M3 for every tensor, gradients included, its fine-grained tile scales making E5M2's
range unnecessary. :class:`Fp8Linear` does that through
:func:`engine.precision.fp8.fp8_matmul`: forward ``y = x W^T``, backward
``dx = dy W`` and ``dW = dy^T x``. Numerics, not speed: nothing here is faster.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.gpt import GPTConfig, TinyGPT
from engine.model.data import token_data
from engine.precision.fp8 import fp8_matmul

PRECISIONS = ("fp32", "bf16", "fp8-tensor", "fp8-row", "fp8-block")


class Fp8Matmul(torch.autograd.Function):
    """``x @ w.T`` with its three matmuls in emulated FP8 (E4M3 forward, E5M2 gradients)."""

    @staticmethod
    def forward(ctx, x, w, scaling, tile):
        ctx.save_for_backward(x, w)
        ctx.scaling, ctx.tile = scaling, tile
        return fp8_matmul(x, w.T, scaling, "e4m3", tile=tile)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = fp8_matmul(dy, w, ctx.scaling, "e5m2", fmt_b="e4m3", tile=ctx.tile)
        dw = fp8_matmul(dy.T.contiguous(), x, ctx.scaling, "e5m2", fmt_b="e4m3", tile=ctx.tile)
        return dx, dw, None, None


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` whose matmuls run in emulated FP8 under ``scaling``."""

    scaling: str = "block"
    tile: int = 16

    def forward(self, x):
        y = Fp8Matmul.apply(x.reshape(-1, x.size(-1)), self.weight, self.scaling, self.tile)
        y = y.reshape(*x.shape[:-1], -1)
        return y + self.bias if self.bias is not None else y


def to_fp8(module: nn.Module, scaling: str = "block", tile: int = 16) -> nn.Module:
    """Every ``nn.Linear`` in ``module`` made an :class:`Fp8Linear` in place (the same
    parameters); returns ``module``."""
    for sub in module.modules():
        if type(sub) is nn.Linear:
            sub.__class__ = Fp8Linear
            sub.scaling, sub.tile = scaling, tile
    return module


def train_lm(precision: str, steps: int = 20, lr: float = 3e-3, cfg: GPTConfig | None = None,
             rows: int = 8, tile: int = 16) -> list[float]:
    """The tiny GPT trained ``steps`` steps with AdamW in ``precision`` (one of
    ``PRECISIONS``; bf16 by CPU autocast); the losses (measured in fp32)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}; expected one of {PRECISIONS}")
    cfg = cfg or GPTConfig(vocab=64, seq_len=16, layers=2, heads=4, hidden=32)
    model = TinyGPT(cfg, seed=0)
    if precision.startswith("fp8"):
        to_fp8(model, precision.split("-")[1], tile)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    ids, targets = token_data(rows, cfg.seq_len, cfg.vocab, seed=1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(ids)
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
