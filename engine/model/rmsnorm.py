"""RMSNorm: LayerNorm without the mean and the bias.

Zhang and Sennrich, "Root Mean Square Layer Normalization" (NeurIPS 2019), eq. 4:

    y = x / sqrt(mean(x^2) + eps) * g

over the last dimension: no mean subtracted, no bias added, one learned gain ``g`` per feature.
Llama (Touvron et al. 2023) and Llama 3 normalise with it, ``eps = 1e-5``. The sum of squares
is taken in fp32 whatever ``x``'s dtype, as Meta's reference code does.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension (module docstring)."""

    def __init__(self, dim: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(x) * self.weight

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
