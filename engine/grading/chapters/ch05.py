"""Checks for chapter 05: column- and row-parallel linear layers with f and g; drills."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.comm import CommMeter
from engine.grading.core import CheckFailed, Exercise, run_ranks
from engine.grading.drill import Drill


def _mlp_on_rank(rank, world_size, module):
    torch.manual_seed(0)
    fc, out = nn.Linear(12, 24), nn.Linear(24, 12)
    x = torch.randn(5, 12, requires_grad=True)
    dense = out(F.gelu(fc(x)))
    dense.square().sum().backward()
    dense_x_grad, x.grad = x.grad.clone(), None
    col, row = module.ColumnParallel(fc), module.RowParallel(out)
    with CommMeter() as forward:
        y = row(F.gelu(col(x)))
    with CommMeter() as backward:
        y.square().sum().backward()
    t = world_size
    wrong = [name for name, ok in (
        ("the output", torch.allclose(y, dense, atol=1e-5)),
        ("the input's gradient", x.grad is not None and
         torch.allclose(x.grad, dense_x_grad, atol=1e-5)),
        ("the column layer's weight gradient",
         torch.allclose(col.weight.grad, fc.weight.grad.chunk(t, 0)[rank], atol=1e-5)),
        ("the column layer's bias gradient",
         torch.allclose(col.bias.grad, fc.bias.grad.chunk(t, 0)[rank], atol=1e-5)),
        ("the row layer's weight gradient",
         torch.allclose(row.weight.grad, out.weight.grad.chunk(t, 1)[rank], atol=1e-5)),
        ("the row layer's bias gradient", torch.allclose(row.bias.grad, out.bias.grad,
                                                         atol=1e-5)),
    ) if not ok]
    return wrong, [e.op for e in forward.events], [e.op for e in backward.events]


def check_matches_the_dense_mlp(module):
    for world_size in (2, 3):
        for rank, (wrong, _, _) in enumerate(run_ranks(_mlp_on_rank, world_size, module,
                                                    timeout=20)):
            if wrong:
                raise CheckFailed(
                    f"rank {rank}: {', '.join(wrong)} differ from the dense MLP. Column keeps "
                    "rows of the weight, row keeps columns; f sums the input's gradient, g "
                    "sums the outputs, and the row bias is added once, after g",
                    world_size=world_size)


def check_one_all_reduce_each_way(module):
    for world_size in (2, 3):
        for rank, (_, fwd, bwd) in enumerate(run_ranks(_mlp_on_rank, world_size, module,
                                                    timeout=20)):
            if fwd != ["all_reduce"] or bwd != ["all_reduce"]:
                raise CheckFailed(
                    f"rank {rank}: the meter saw {fwd} forward and {bwd} backward; a column "
                    "then row MLP needs exactly one all-reduce each way (g forward, f "
                    "backward), through engine.comm.ops", world_size=world_size)


EXERCISES = [
    Exercise(
        name="ch05.parallel_linear",
        title="Column- and row-parallel linear layers with f and g",
        module="ch05_parallel_linear",
        attr="",
        checks=(check_matches_the_dense_mlp, check_one_all_reduce_each_way),
        hints=(
            "Split the first layer by output rows and the second by input columns: the "
            "activation between them stays split, so only the end needs a sum. f and g mirror "
            "each other: what one does forward, the other does backward.",
            "A torch.autograd.Function has static forward(ctx, x, group) and backward(ctx, "
            "grad), which returns one gradient per forward input: (grad, None). "
            "ops.all_reduce(t, group=group) sums in place; dense.weight.chunk(t, dim)[rank] is "
            "this rank's block; F.linear(x, weight, bias).",
            "_F.forward: ctx.group = group; return x.view_as(x). _F.backward: all-reduce a "
            "clone of grad; return it, None. _G: the reverse. ColumnParallel: weight and bias "
            "chunks on dim 0; forward F.linear(f(x), W, b). RowParallel: weight chunk on dim 1, "
            "whole bias; forward g(F.linear(x, W)) + bias.",
        ),
        blocks=("engine.tp.mappings.copy_to_tp", "engine.tp.mappings.reduce_from_tp",
                "engine.tp.mappings._CopyToTP.forward", "engine.tp.mappings._CopyToTP.backward",
                "engine.tp.mappings._ReduceFromTP.forward",
                "engine.tp.layers.ColumnParallelLinear.__init__",
                "engine.tp.layers.RowParallelLinear.__init__"),
    ),
]

DRILLS = [  # questions from engine.drill's bank: the answers are computed, not typed
    Drill("ch05.all_reduces_per_layer", "tp-all-reduces"),
    Drill("ch05.params_per_layer", "layer-params"),
    Drill("ch05.one_all_reduce_claim", "tp-one-allreduce"),
]
