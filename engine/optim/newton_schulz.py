"""The Newton-Schulz iteration Muon orthogonalises its update with, and its FLOPs.

Muon's update matrix ``M`` is the Nesterov-style blend of the gradient and the momentum
(``grad.lerp(momentum, beta)``, :func:`engine.optim.muon_update`). The orthogonal matrix
nearest to it is ``U V^T`` for ``M = U S V^T``; Muon does not compute it exactly but, without an
SVD, a few steps of the quintic ``X <- a X + b (X X^T) X + c (X X^T)^2 X``, which keep the
singular vectors and push every singular value of ``X`` (normalised to spectral norm <= 1)
towards 1. The coefficients ``(3.4445, -4.7750, 2.0315)`` are Keller Jordan's ("Muon: An
optimizer for hidden layers in neural networks", 2024, https://kellerjordan.github.io/posts/muon/),
chosen to make the slope at 0 as steep as possible, beyond the point where the iteration still
converges to 1: after 5 steps the result is approximately ``U S' V^T`` with the singular values
``S'`` in about [0.7, 1.2], not ``U V^T``, which by his note is all Muon needs. The matrix is
transposed first when it is tall, so that ``X X^T`` is the smaller Gram matrix.
"""

from __future__ import annotations

import torch

COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic (a, b, c)


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """An approximately orthogonal matrix with ``g``'s singular vectors (``g`` 2-D; in fp32
    here, where Keller Jordan's GPU code runs it in bf16)."""
    if g.dim() != 2:
        raise ValueError(f"newton_schulz takes a matrix, got shape {tuple(g.shape)}")
    a, b, c = COEFFICIENTS
    tall = g.size(0) > g.size(1)
    x = g.float().T if tall else g.float()
    x = x / (x.norm() + eps)  # Frobenius >= spectral norm: every singular value <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def newton_schulz_flops(rows: int, cols: int, steps: int = 5) -> int:
    """Matmul FLOPs of :func:`newton_schulz` on a ``rows x cols`` matrix (``m = min``,
    ``n = max``): per step ``X X^T`` ``2 m^2 n``, its square ``2 m^3``, the product with ``X``
    ``2 m^2 n``."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)
