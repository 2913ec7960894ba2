"""The small MLP of the first chapters (data parallelism, ZeRO, compression)."""

from __future__ import annotations

import torch
import torch.nn as nn

from engine.model.seed import seeded


class MLP(nn.Module):
    """``sizes=(8, 32, 4)`` gives Linear(8,32) -> GELU -> Linear(32,4)."""

    def __init__(self, sizes=(16, 64, 64, 8), seed: int = 0):
        super().__init__()
        if len(sizes) < 2 or any(int(s) < 1 for s in sizes):
            raise ValueError(f"sizes must list >= 2 positive layer widths, got {sizes!r}")
        layers: list[nn.Module] = []
        with seeded(seed):
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
                layers.append(nn.Linear(a, b))
                if i < len(sizes) - 2:
                    layers.append(nn.GELU())
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
