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

**Sequence parallelism** (Korthikanti et al., "Reducing activation recomputation in large
transformer models", MLSys 2023, section 4.2.2) keeps the activations between the parallel
blocks split along the *sequence* (dim 1 of ``(batch, seq, hidden)``), and replaces each
all-reduce by its two halves (a ring all-reduce *is* a reduce-scatter then an all-gather):

* :func:`gather_from_sequence_parallel` (Megatron's g): all-gather of the sequence forward,
  reduce-scatter of the gradient backward. It enters a column-parallel layer, where f was;
* :func:`reduce_scatter_to_sequence_parallel` (g-bar): reduce-scatter forward, all-gather
  backward. It leaves a row-parallel layer, where g was;
* :func:`scatter_to_sequence_parallel`: this rank's part of a whole sequence, all-gather of
  the gradient backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

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


def gather_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's slice ``x`` of a tensor cut on ``dim``, joined in rank order: one
    all-gather over the tensor-parallel ``group``. Not differentiable (for checking and
    saving)."""
    return gather_from_tp(x.detach().movedim(dim, -1).contiguous(), group).movedim(-1, dim)


# -- sequence parallelism ----------------------------------------------------------------------


def check_sequence_split(seq_len: int, t: int) -> None:
    """A clear error unless ``t`` ranks can each take ``seq_len / t`` tokens (call it before
    any collective, or before any rank starts)."""
    if seq_len % t:
        raise ValueError(f"sequence parallelism splits the sequence: length {seq_len} is not "
                         f"divisible by the tensor-parallel degree {t}")


def _split_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    t, r = dist.get_world_size(group), dist.get_rank(group)
    check_sequence_split(x.shape[dim], t)
    return x.chunk(t, dim=dim)[r].contiguous()


def _gather_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    t = dist.get_world_size(group)
    if t == 1:
        return x
    local = x.movedim(dim, 0).contiguous()
    out = torch.empty((t * local.shape[0],) + tuple(local.shape[1:]), dtype=x.dtype,
                      device=x.device)
    ops.all_gather_into_tensor(out, local, group=group)
    return out.movedim(0, dim)


def _reduce_scatter_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    t = dist.get_world_size(group)
    if t == 1:
        return x
    check_sequence_split(x.shape[dim], t)
    whole = x.movedim(dim, 0).contiguous()
    out = torch.empty((whole.shape[0] // t,) + tuple(whole.shape[1:]), dtype=x.dtype,
                      device=x.device)
    ops.reduce_scatter_tensor(out, whole, group=group)
    return out.movedim(0, dim)


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split_sequence(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad, ctx.group, ctx.dim), None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_sequence(grad, ctx.group), None


class _GatherSequenceForReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):  # every rank computed the same gradient of the whole sequence
        return _split_sequence(grad, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad, ctx.group), None


class _GatheredLinear(torch.autograd.Function):
    """``linear(all_gather(x_r))`` keeping only ``x_r`` for backward, which gathers it again
    for the weight gradient (Korthikanti et al. 2023, section 4.2.2; Megatron-LM overlaps this
    all-gather with the input gradient): the layer's input costs ``s/t`` tokens of memory, at
    the price of one more all-gather per layer in backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(_gather_sequence(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        whole = _gather_sequence(x, ctx.group)  # again: only the shard was kept
        grad_input = _reduce_scatter_sequence(grad @ weight, ctx.group)
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_weight = flat_grad.t() @ whole.reshape(-1, whole.shape[-1])
        grad_bias = flat_grad.sum(0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None


def scatter_to_sequence_parallel(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """This rank's ``1/t`` of the sequence (along ``dim``); backward all-gathers the gradient."""
    return _ScatterToSequence.apply(x, group, dim)


def gather_from_sequence_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather the sequence forward, reduce-scatter the gradient backward."""
    return _GatherFromSequence.apply(x, group)


def gather_sequence_for_replicated(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather the sequence forward, for a computation every rank repeats whole on it
    (weights replicated over the group, e.g. an MoE layer's whole experts); backward keeps
    this rank's slice of the gradient, which every rank computed the same (Megatron-LM's
    ``gather_from_sequence_parallel_region(tensor_parallel_output_grad=False)``)."""
    return _GatherSequenceForReplicated.apply(x, group)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum the ranks' partial outputs and keep this rank's ``1/t`` of the sequence (forward);
    all-gather the gradient (backward)."""
    return _ReduceScatterToSequence.apply(x, group)


def gathered_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    group=None) -> torch.Tensor:
    """``F.linear(gather_from_sequence_parallel(x), weight, bias)``, storing only ``x``."""
    return _GatheredLinear.apply(x, weight, bias, group)
