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
        hint="f: forward returns x, backward all-reduces grad. g: the reverse. Column: "
             "weight.chunk(t, 0)[rank], bias.chunk(t, 0)[rank], forward linear(f(x)). Row: "
             "weight.chunk(t, 1)[rank], whole bias, forward g(linear(x, W)) + bias.",
    ),
]

DRILLS = [
    Drill("ch05.all_reduces_per_layer",
          "Megatron tensor parallelism: how many all-reduces does one transformer layer need "
          "for one forward and one backward pass?", 4,
          "Two forward (g after attention, g after the MLP) and two backward (f before each): "
          "4, not 1."),
    Drill("ch05.gpt3_params_per_layer",
          "GPT-3 175B has hidden size 12288. About how many billion parameters are in one "
          "transformer layer (12 h^2)?", 1.81,
          "12 x 12288^2 = 1.81 billion parameters: 3.6 GB in fp16, not '1.8 GB per layer'."),
]
