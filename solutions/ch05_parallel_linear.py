"""Reference for exercise ch05.parallel_linear: Megatron's f and g as autograd Functions
(Shoeybi et al., "Megatron-LM", 2019, section 3 and figure 3), and the column- and
row-parallel linear layers built on them."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.comm import ops


class _F(torch.autograd.Function):
    """f: identity forward; all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()  # autograd may hand the same gradient to others: sum a copy
        ops.all_reduce(grad, group=ctx.group)
        return grad, None


class _G(torch.autograd.Function):
    """g: all-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        ops.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def f(x, group=None):
    return _F.apply(x, group)


def g(x, group=None):
    return _G.apply(x, group)


class ColumnParallel(nn.Module):
    """Keep this rank's block of *output* rows of ``dense`` (weight and bias). Forward: f on
    the input, then the local linear; return this rank's slice of the outputs."""

    def __init__(self, dense: nn.Linear, group=None):
        super().__init__()
        rank, t = dist.get_rank(group), dist.get_world_size(group)
        self.group = group
        self.weight = nn.Parameter(dense.weight.detach().chunk(t, dim=0)[rank].clone())
        self.bias = nn.Parameter(dense.bias.detach().chunk(t, dim=0)[rank].clone())

    def forward(self, x):
        return F.linear(f(x, self.group), self.weight, self.bias)


class RowParallel(nn.Module):
    """Keep this rank's block of *input* columns of ``dense``'s weight, and the whole bias.
    Forward: take this rank's slice of the outputs of a ColumnParallel layer, multiply, g, and
    add the bias once."""

    def __init__(self, dense: nn.Linear, group=None):
        super().__init__()
        rank, t = dist.get_rank(group), dist.get_world_size(group)
        self.group = group
        self.weight = nn.Parameter(dense.weight.detach().chunk(t, dim=1)[rank].clone())
        self.bias = nn.Parameter(dense.bias.detach().clone())

    def forward(self, x_slice):
        return g(F.linear(x_slice, self.weight), self.group) + self.bias
