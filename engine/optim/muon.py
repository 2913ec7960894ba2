"""Muon: momentum, orthogonalised by Newton-Schulz, scaled by the matrix's shape.

Keller Jordan et al., "Muon: An optimizer for hidden layers in neural networks" (2024,
https://github.com/KellerJordan/Muon). For each weight matrix ``W`` with gradient ``G``::

    B <- mu B + (1 - mu) G                      (momentum; B.lerp_(G, 1 - mu))
    M <- (1 - mu) G + mu B  if nesterov else B   (G.lerp(B, mu))
    O <- NewtonSchulz5(M)                        (engine.optim.newton_schulz)
    W <- W - lr * sqrt(max(1, rows / cols)) * O

The shape scale is Keller Jordan's convention, ``max(1, rows/cols) ** 0.5`` (his ``muon.py``,
``muon_update``); Moonlight (Liu et al., "Muon is Scalable for LLM Training", 2025) uses
``0.2 * sqrt(max(rows, cols))`` instead, to match AdamW's update RMS. Muon is for the hidden
matrices only: embeddings, the output head, norms and biases go to AdamW in a second optimizer
(:func:`split_params` does the split by dimension). A 4-D convolution kernel is flattened to
``out x (in * kh * kw)``.
"""

from __future__ import annotations

import torch

from engine.optim.newton_schulz import newton_schulz


def check_matrix(p: torch.Tensor, where: str) -> None:
    if p.dim() < 2:
        raise ValueError(f"Muon orthogonalises matrices: {where} has shape {tuple(p.shape)} "
                         f"({p.dim()}-D); give embeddings, norms and biases to "
                         "torch.optim.AdamW in a second optimizer (engine.optim.split_params)")


def shape_scale(rows: int, cols: int) -> float:
    """Keller Jordan's ``max(1, rows / cols) ** 0.5``."""
    return max(1.0, rows / cols) ** 0.5


def muon_update(grad: torch.Tensor, momentum: torch.Tensor, beta: float, nesterov: bool,
                ns_steps: int) -> torch.Tensor:
    """Advance ``momentum`` (in place) by ``grad`` and return the orthogonalised, scaled
    update, shaped as the parameter."""
    momentum.lerp_(grad, 1 - beta)
    update = grad.lerp(momentum, beta) if nesterov else momentum
    matrix = update.reshape(update.size(0), -1)
    out = newton_schulz(matrix, ns_steps) * shape_scale(*matrix.shape)
    return out.reshape(grad.shape).to(grad.dtype)


def check_hyperparameters(lr: float, momentum: float) -> None:
    """A clear error for an ``lr`` that is not positive or a ``momentum`` outside [0, 1)."""
    if not lr > 0:
        raise ValueError(f"lr must be positive, got {lr!r}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")


class Muon(torch.optim.Optimizer):
    """Muon for matrices (2-D or more). Pair it with AdamW for the rest (:func:`split_params`).
    """

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5):
        check_hyperparameters(lr, momentum)
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov,
                                      ns_steps=ns_steps))
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                check_matrix(p, f"parameter {i} of group {g}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                update = muon_update(p.grad, state["momentum_buffer"], group["momentum"],
                                     group["nesterov"], group["ns_steps"])
                p.add_(update, alpha=-group["lr"])
        return loss


def split_params(module: torch.nn.Module, heads: tuple[str, ...] = ("head", "lm_head")
                 ) -> tuple[list, list]:
    """(matrices for Muon, the rest for AdamW): the parameters of 2 dims or more, except those
    of ``nn.Embedding`` modules and of modules named in ``heads`` (the output layer); a tied
    parameter once."""
    matrices, rest, seen = [], [], set()
    for name, sub in module.named_modules():
        for p in sub.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            input_or_output = isinstance(sub, torch.nn.Embedding) or name.split(".")[-1] in heads
            (matrices if p.dim() >= 2 and not input_or_output else rest).append(p)
    return matrices, rest
