"""The differentiable all-to-all (the engine's one all-to-all that autograd can see through), and a
differentiable all-reduce (:func:`all_reduce`).

The gradient of an all-to-all is the all-to-all the other way: what rank i sent to rank j as
rows of its input, rank j's gradient sends back to rank i, so the backward is the same
exchange with the input and output splits swapped, and crosses the wire as many times as the
forward. Expert parallelism's dispatch and combine (:mod:`engine.moe.dispatch`; Lepikhin et
al., GShard, 2021) send uneven, data-dependent splits; Ulysses (:mod:`engine.cp.ulysses`;
Jacobs et al., 2023) sends even ones, as pieces stacked along dim 0.

Built on :mod:`engine.comm.ops` (the facade over the collectives), so a ``CommMeter`` sees
every byte, forward and backward, and inside ``CommMeter(count="wire")`` counts it.
"""

from __future__ import annotations

import torch

from engine.comm import ops
from engine.observe.meter import comm_purpose, current_purpose


class AllToAll(torch.autograd.Function):
    """All-to-all of rows (split along dim 0); backward is the same all-to-all with the splits
    swapped. Splits ``None``: equal pieces. The backward's events carry the purpose the
    forward's did (:class:`engine.observe.meter.comm_purpose`), whichever thread runs it."""

    @staticmethod
    def forward(ctx, rows, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        ctx.purpose = current_purpose()
        return _exchange(rows, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        with comm_purpose(ctx.purpose):
            return _exchange(grad, input_splits, output_splits, ctx.group), None, None, None


def _exchange(rows: torch.Tensor, output_splits, input_splits, group) -> torch.Tensor:
    received = rows.shape[0] if output_splits is None else sum(output_splits)
    out = rows.new_empty((received, *rows.shape[1:]))
    ops.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group)
    return out


def all_to_all(rows: torch.Tensor, output_splits: list[int] | None = None,
               input_splits: list[int] | None = None, group=None) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` of ``rows`` (split along dim 0): rank i's piece j
    lands in rank j's output, piece i. ``None`` splits: equal pieces."""
    return AllToAll.apply(rows, None if output_splits is None else list(output_splits),
                          None if input_splits is None else list(input_splits), group)


class AllReduce(torch.autograd.Function):
    """Sum over ``group`` on every rank; backward sums the gradients over ``group`` too. Every
    rank's output is the same sum, and each rank's loss uses its copy, so the gradient of
    rank i's input is the sum of every rank's gradient of that output (as
    ``torch.distributed.nn.functional.all_reduce``), not only its own (Megatron's
    ``reduce_from_tensor_model_parallel_region``, which passes the gradient through, is for
    outputs whose gradients are already equal)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.purpose = group, current_purpose()
        out = x.clone()
        ops.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        with comm_purpose(ctx.purpose):
            ops.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """Differentiable sum of ``x`` over ``group`` (:class:`AllReduce`)."""
    return AllReduce.apply(x, group)
