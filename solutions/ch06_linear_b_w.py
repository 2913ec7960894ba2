"""Reference for exercise ch06.linear_b_w (the engine's is engine/pp/weight_grad.py)."""

import torch


def linear_b(grad_out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """B of ``Y = X Wᵀ + b``: ``dX = dY W``."""
    return torch.matmul(grad_out, weight)


def linear_w(x: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W of ``Y = X Wᵀ + b``: ``dW = dYᵀ X`` and ``db = Σ dY`` over every leading index."""
    rows_out = grad_out.reshape(-1, grad_out.shape[-1])
    rows_in = x.reshape(-1, x.shape[-1])
    return rows_out.t() @ rows_in, rows_out.sum(dim=0)
