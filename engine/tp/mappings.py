"""The four communication operators of Megatron-LM tensor parallelism, as autograd Functions.

Shoeybi et al., "Megatron-LM: Training multi-billion parameter language models using model
parallelism" (2019), section 3 and Figure 3:

* ``f`` = :func:`copy_to_tp`: identity in forward, all-reduce of the gradient in backward.
  It sits where a replicated activation enters a column-parallel layer: every rank computes
  a different slice from the same input, so the input's gradient is the sum of the slices'.
* ``g`` = :func:`reduce_from_tp`: all-reduce in forward, identity in backward. It sits where a
  row-parallel layer's partial sums become the full output.

f and g are conjugates: each is the other's transpose, so a column-parallel layer followed by
a row-parallel one costs one all-reduce forward (g) and one backward (f).

:func:`scatter_to_tp` and :func:`gather_from_tp` split or concatenate the last dimension
(used when a layer's input or output must be whole on every rank). All communication goes
through :mod:`engine.comm.ops`, so ``CommMeter`` counts it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.comm import ops


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    x = x.contiguous()
    ops.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    t, r = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[-1] % t:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by the tensor-parallel "
                         f"degree {t}")
    return x.chunk(t, dim=-1)[r].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    t = dist.get_world_size(group)
    if t == 1:
        return x
    out = torch.empty((t,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    ops.all_gather_into_tensor(out.view(-1), x.contiguous().view(-1), group=group)
    return torch.cat(out.unbind(0), dim=-1)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's f: identity forward, all-reduce backward."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's g: all-reduce forward, identity backward."""
    return _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's slice of the last dimension; backward all-gathers the gradient."""
    return _ScatterToTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every rank's slice along the last dimension; backward keeps this rank's."""
    return _GatherFromTP.apply(x, group)
