"""Reference for exercise ch10.balancing_loss (the engine's version is in
engine/moe/router.py)."""

import torch


def load_balancing_loss(probs, expert, alpha=0.01):
    experts = probs.shape[-1]
    f = torch.bincount(expert.reshape(-1), minlength=experts).to(probs.dtype) / expert.numel()
    p = probs.mean(dim=0)
    return alpha * experts * (f * p).sum()
