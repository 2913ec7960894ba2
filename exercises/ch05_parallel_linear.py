"""Exercise ch05.parallel_linear: Megatron's f and g, and the two ways to split a linear layer.

Fill in ``f``, ``g``, ``ColumnParallel`` and ``RowParallel``, save, then run
``check("ch05.parallel_linear")`` in course/05_tensor_parallel.ipynb (or ``make grade``). The
checks build ``RowParallel(GELU(ColumnParallel(x)))`` from a dense MLP at 2 and 3 ranks and
compare outputs and every gradient (the input's too) with the dense MLP, and count the
all-reduces: exactly one forward and one backward.
"""

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)
import torch.nn.functional as F  # noqa: F401
from torch import nn

from engine.comm import ops  # noqa: F401  (all-reduce through ops, so the meter sees it)


class _F(torch.autograd.Function):
    """f: identity forward; all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("ch05.parallel_linear: write me")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("ch05.parallel_linear: write me")


class _G(torch.autograd.Function):
    """g: all-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("ch05.parallel_linear: write me")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("ch05.parallel_linear: write me")


def f(x, group=None):
    return _F.apply(x, group)


def g(x, group=None):
    return _G.apply(x, group)


class ColumnParallel(nn.Module):
    """Keep this rank's block of *output* rows of ``dense`` (weight and bias). Forward: f on
    the input, then the local linear; return this rank's slice of the outputs."""

    def __init__(self, dense: nn.Linear, group=None):
        super().__init__()
        raise NotImplementedError("ch05.parallel_linear: write me")

    def forward(self, x):
        raise NotImplementedError("ch05.parallel_linear: write me")


class RowParallel(nn.Module):
    """Keep this rank's block of *input* columns of ``dense``'s weight, and the whole bias.
    Forward: take this rank's slice of the outputs of a ColumnParallel layer, multiply, g, and
    add the bias once."""

    def __init__(self, dense: nn.Linear, group=None):
        super().__init__()
        raise NotImplementedError("ch05.parallel_linear: write me")

    def forward(self, x_slice):
        raise NotImplementedError("ch05.parallel_linear: write me")
