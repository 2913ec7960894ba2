"""Reference for exercise ch05.parallel_linear."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.comm import ops


def _all_reduce(x, group):
    x = x.clone()
    ops.all_reduce(x, group=group)
    return x


class _F(torch.autograd.Function):
    """f: identity forward; all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _G(torch.autograd.Function):
    """g: all-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def f(x, group=None):
    return _F.apply(x, group)


def g(x, group=None):
    return _G.apply(x, group)


class ColumnParallel(nn.Module):
    def __init__(self, dense: nn.Linear, group=None):
        super().__init__()
        rank, t = dist.get_rank(group), dist.get_world_size(group)
        self.group = group
        self.weight = nn.Parameter(dense.weight.detach().chunk(t, dim=0)[rank].clone())
        self.bias = nn.Parameter(dense.bias.detach().chunk(t, dim=0)[rank].clone())

    def forward(self, x):
        return F.linear(f(x, self.group), self.weight, self.bias)


class RowParallel(nn.Module):
    def __init__(self, dense: nn.Linear, group=None):
        super().__init__()
        rank, t = dist.get_rank(group), dist.get_world_size(group)
        self.group = group
        self.weight = nn.Parameter(dense.weight.detach().chunk(t, dim=1)[rank].clone())
        self.bias = nn.Parameter(dense.bias.detach().clone())

    def forward(self, x_slice):
        return g(F.linear(x_slice, self.weight), self.group) + self.bias
