"""Checks for chapter 05: column- and row-parallel linear layers with f and g; drills."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.observe.meter import CommMeter
from engine.grading.core import CheckFailed, Exercise, passed, run_ranks
from engine.grading.drill import Drill


def _mlp_layers():
    """The dense MLP and its input, from seed 0 (the global RNG: call it where that is free)."""
    torch.manual_seed(0)
    fc, out = nn.Linear(12, 24), nn.Linear(24, 12)
    x = torch.randn(5, 12, requires_grad=True)
    return fc, out, x


def _grad(t: torch.Tensor):
    return None if t.grad is None else t.grad.detach().clone()


def _mlp_on_rank(rank, world_size, module):
    """A driver (runs where the learner's code does): the learner's layers built from the dense
    ones, run forward and backward; what they gave and what the meter saw. The check compares
    it with the dense MLP computed in the grader."""
    fc, out, x = _mlp_layers()
    col, row = module.ColumnParallel(fc), module.RowParallel(out)
    with CommMeter() as forward:
        y = row(F.gelu(col(x)))
    with CommMeter() as backward:
        y.square().sum().backward()
    return dict(y=y.detach().clone(), x_grad=_grad(x), col_weight=_grad(col.weight),
                col_bias=_grad(col.bias), row_weight=_grad(row.weight), row_bias=_grad(row.bias),
                forward=[e.op for e in forward.events], backward=[e.op for e in backward.events])


def _dense_mlp() -> dict:
    """The dense MLP's output and gradients, computed in the grader (its RNG left as it was)."""
    with torch.random.fork_rng(devices=[]):
        fc, out, x = _mlp_layers()
    dense = out(F.gelu(fc(x)))
    dense.square().sum().backward()
    return dict(y=dense.detach(), x_grad=x.grad, col_weight=fc.weight.grad,
                col_bias=fc.bias.grad, row_weight=out.weight.grad, row_bias=out.bias.grad)


def _close(got, expected) -> bool:
    return got is not None and torch.allclose(got, expected, atol=1e-5)


def _mlp_results(module, world_size):
    return run_ranks(_mlp_on_rank, world_size, module, timeout=20)


def check_matches_the_dense_mlp(module):
    dense = _dense_mlp()
    for world_size in (2, 3):
        t = world_size
        for rank, res in enumerate(_mlp_results(module, world_size)):
            wrong = [name for name, ok in (
                ("the output", torch.allclose(res["y"], dense["y"], atol=1e-5)),
                ("the input's gradient", _close(res["x_grad"], dense["x_grad"])),
                ("the column layer's weight gradient",
                 _close(res["col_weight"], dense["col_weight"].chunk(t, 0)[rank])),
                ("the column layer's bias gradient",
                 _close(res["col_bias"], dense["col_bias"].chunk(t, 0)[rank])),
                ("the row layer's weight gradient",
                 _close(res["row_weight"], dense["row_weight"].chunk(t, 1)[rank])),
                ("the row layer's bias gradient", _close(res["row_bias"], dense["row_bias"])),
            ) if not ok]
            if wrong:
                raise CheckFailed(
                    f"rank {rank}: {', '.join(wrong)} differ from the dense MLP. Column keeps "
                    "rows of the weight, row keeps columns; f sums the input's gradient, g "
                    "sums the outputs, and the row bias is added once, after g",
                    world_size=world_size)


def check_one_all_reduce_each_way(module):
    for world_size in (2, 3):
        for rank, res in enumerate(_mlp_results(module, world_size)):
            fwd, bwd = res["forward"], res["backward"]
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


# -- ch05.vocab_parallel_ce -------------------------------------------------------------------

VOCAB, TOKENS_SHAPE = 96, (3, 5)
LARGE = 90.0  # exp(90) overflows fp32 (largest ~3.4e38): the max must be subtracted first


def _vocab_ce_data():
    """The dense logits (row 0 near LARGE), the targets and a weight per token's loss."""
    gen = torch.Generator().manual_seed(7)
    dense = torch.randn(*TOKENS_SHAPE, VOCAB, generator=gen) * 3
    dense[0] += LARGE  # one row of tokens with huge logits
    targets = torch.randint(0, VOCAB, TOKENS_SHAPE, generator=gen)
    weights = torch.rand(*TOKENS_SHAPE, generator=gen)  # a different gradient per token
    return dense, targets, weights


def _vocab_ce_on_rank(rank, world_size, module):
    """A driver (runs where the learner's code does): the learner's loss on this rank's slice
    of the logits, that slice's gradient, and what the meter saw; compared in the grader."""
    dense, targets, weights = _vocab_ce_data()
    logits = dense.chunk(world_size, dim=-1)[rank].clone().requires_grad_()
    with CommMeter() as meter:
        loss = module.vocab_parallel_cross_entropy(logits, targets)
        (loss * weights).sum().backward()
    return dict(loss=loss.detach().clone() if isinstance(loss, torch.Tensor) else repr(loss),
                grad=None if logits.grad is None else logits.grad.detach().clone(),
                events=[(e.op, e.payload_bytes) for e in meter.events])


def _dense_cross_entropy():
    """F.cross_entropy per token and its gradient (weighted per token), in the grader."""
    dense, targets, weights = _vocab_ce_data()
    reference = dense.clone().requires_grad_()
    expected = F.cross_entropy(reference.view(-1, VOCAB), targets.view(-1),
                               reduction="none").view(TOKENS_SHAPE)
    (expected * weights).sum().backward()
    return expected.detach(), reference.grad


def _first_two(loss):
    if not isinstance(loss, torch.Tensor):
        return loss
    return (loss[0, :2] if loss.dim() == 2 else loss.flatten()[:2]).tolist()


def check_matches_dense_cross_entropy(module):
    expected, expected_grad = _dense_cross_entropy()
    for world_size in (2, 3):
        for rank, res in enumerate(run_ranks(_vocab_ce_on_rank, world_size, module,
                                             timeout=20)):
            loss, grad = res["loss"], res["grad"]
            wrong = []
            if not (isinstance(loss, torch.Tensor) and loss.shape == expected.shape
                    and torch.allclose(loss, expected, rtol=1e-5, atol=1e-5)):
                wrong.append("the loss")
            if grad is None or not torch.allclose(
                    grad, expected_grad.chunk(world_size, dim=-1)[rank], atol=1e-6):
                wrong.append("the gradient of this rank's logits")
            if wrong:
                raise CheckFailed(
                    f"rank {rank}: {' and '.join(wrong)} differ from the dense "
                    f"F.cross_entropy (tokens of row 0, logits near {LARGE:.0f}: got "
                    f"{_first_two(loss)}, expected {expected[0, :2].tolist()}). Subtract the "
                    "global max before exp(); the target's logit comes from the rank that "
                    "holds it; the gradient is softmax minus one-hot", world_size=world_size,
                    vocab=VOCAB, tokens=TOKENS_SHAPE)


def check_never_gathers_the_logits(module):
    tokens = TOKENS_SHAPE[0] * TOKENS_SHAPE[1]
    for world_size in (2, 3):
        for rank, res in enumerate(run_ranks(_vocab_ce_on_rank, world_size, module,
                                             timeout=20)):
            ops_seen = sorted({op for op, _ in res["events"]})
            payload = sum(size for _, size in res["events"])
            if ops_seen != ["all_reduce"] or payload > 3 * 4 * tokens:
                raise CheckFailed(
                    f"rank {rank}: the meter saw {res['events']}; the loss needs three "
                    f"all-reduces of one number per token (the max, the sum of exponentials, "
                    f"the target's logit): at most 3 x {tokens} tokens x 4 bytes = "
                    f"{3 * 4 * tokens}, never the {VOCAB // world_size} logits per token of a "
                    "rank. Use ops.all_reduce", world_size=world_size, vocab=VOCAB)
    return passed(f"all-reduced {payload // (4 * tokens)} numbers per token instead of "
                  f"gathering {VOCAB} logits", "the max, Σ exp, the target's logit",
                  V=VOCAB, t=world_size)


EXERCISES.append(Exercise(
    name="ch05.vocab_parallel_ce",
    title="The vocabulary-parallel cross-entropy",
    module="ch05_vocab_parallel_ce",
    attr="",
    checks=(check_matches_dense_cross_entropy, check_never_gathers_the_logits),
    hints=(
        "log Σ exp(z) needs only two numbers per token from each rank's slice: its max and "
        "its sum of exp(z - max). The target's logit lives on exactly one rank. So three "
        "all-reduces of one number per token replace gathering V numbers per token; and the "
        "gradient, softmax - onehot, is local to each slice.",
        "ops.all_reduce(t, op=dist.ReduceOp.MAX, group=group), then plain sums; this rank's "
        "words start at dist.get_rank(group) * logits.shape[-1]; logits.gather(-1, idx) picks "
        "a logit per token; masked_fill zeroes the tokens whose target is elsewhere; "
        "ctx.save_for_backward keeps tensors for backward.",
        "forward: top = logits.max(-1).values, all-reduce MAX; shifted = logits - top[..., "
        "None]; exp = shifted.exp(); total = exp.sum(-1), all-reduce; local = targets - "
        "start; mine = (0 <= local < V/t); picked = shifted.gather(-1, local.clamp) masked by "
        "mine, all-reduce; save exp / total[..., None], local, mine; return total.log() - "
        "picked. backward: grad = softmax; grad[mine, local] -= 1; return grad * "
        "grad_loss[..., None], None, None",
    ),
    blocks=("engine.tp.layers.vocab_parallel_cross_entropy",
            "engine.tp.layers._VocabParallelCrossEntropy.forward",
            "engine.tp.layers._VocabParallelCrossEntropy.backward"),
))
