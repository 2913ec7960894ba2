"""Split a backward into B (input gradient, now) and W (weight gradient, later).

For a linear layer ``Y = X Wᵀ + b`` with output gradient ``dY`` (Qi et al., "Zero Bubble
Pipeline Parallelism", ICLR 2024, section 2):

* **B**: ``dX = dY W``. The previous pipeline stage is waiting for it.
* **W**: ``dW = dYᵀ X`` and ``db = Σ dY``. Nobody waits for these, so a schedule may run them
  later, in what would otherwise be a bubble, as long as ``X`` and ``dY`` are kept until then.

Inside ``with deferred_weight_grads(weights) as stash:`` every ``torch.nn.functional.linear``
(every ``nn.Linear``) whose weight is one of ``weights`` records an autograd node whose
backward returns only ``dX`` and appends ``(X, dY, weight, bias)`` to ``stash``;
:func:`apply_weight_grads` later adds ``dYᵀ X`` and ``Σ dY`` to the parameters' ``.grad``.
After B, autograd frees the rest of the graph: what stays is exactly the W-stash, the layers'
inputs and output gradients. Parameters of other layers (a norm, an embedding) get their
gradient during B as usual, as in DeepSeek's DualPipe, whose ``WeightGradStore`` defers only
its linear layers' weight gradients the same way.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

Stashed = tuple  # (X, dY, weight, bias or None)


def linear_input_grad(grad_out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """B of ``Y = X Wᵀ + b``: ``dX = dY W`` (any leading dimensions)."""
    return grad_out @ weight


def linear_weight_grad(x: torch.Tensor, grad_out: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """W of ``Y = X Wᵀ + b``: ``(dW, db) = (dYᵀ X, Σ dY)``, summed over every leading
    dimension (every row of the micro-batch)."""
    dy = grad_out.reshape(-1, grad_out.shape[-1])
    return dy.t() @ x.reshape(-1, x.shape[-1]), dy.sum(0)


class _LinearInputGradOnly(torch.autograd.Function):
    """``F.linear`` whose backward gives ``dX = dY W`` and stashes ``X, dY`` for W."""

    @staticmethod
    def forward(ctx, x, weight, bias, stash):
        ctx.save_for_backward(x)  # an activation; the parameters are kept as themselves, so
        ctx.weight, ctx.bias, ctx.stash = weight, bias, stash  # W reaches their .grad
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        ctx.stash.append((x, grad_out, ctx.weight, ctx.bias))
        grad_x = linear_input_grad(grad_out, ctx.weight) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None


class _DeferLinearWeightGrads(TorchFunctionMode):
    def __init__(self, weights: Iterable[torch.Tensor], stash: list):
        super().__init__()
        self.weights = {id(w) for w in weights}
        self.stash = stash

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = _linear_args(*args, **kwargs)
            if id(weight) in self.weights:
                return _LinearInputGradOnly.apply(x, weight, bias, self.stash)
        return func(*args, **kwargs)


def _linear_args(input, weight, bias=None):
    return input, weight, bias


@contextmanager
def deferred_weight_grads(weights: Iterable[torch.Tensor]):
    """Run a forward whose backward will compute only B for the linear layers with these
    ``weights``; yields the stash that backward fills for :func:`apply_weight_grads`."""
    stash: list[Stashed] = []
    with _DeferLinearWeightGrads(weights, stash):
        yield stash


@torch.no_grad()  # X may require grad (a stage's input, an expert's rows): dW enters no graph
def apply_weight_grads(stash: list[Stashed]) -> None:
    """W: add each stashed layer's ``dW = dYᵀ X`` (and ``db = Σ dY``) to ``.grad``, then drop
    the stash."""
    for x, grad_out, weight, bias in stash:
        grad_weight, grad_bias = linear_weight_grad(x, grad_out)
        _accumulate(weight, grad_weight)
        if bias is not None:
            _accumulate(bias, grad_bias)
    stash.clear()


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad
