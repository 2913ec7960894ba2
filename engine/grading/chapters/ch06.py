"""Checks for chapter 06: a 1F1B schedule generator; drills on choosing m."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import theory
from engine.model.seed import seeded
from engine.pp import (interleaved_1f1b, run_pipeline, simulate, split_model,
                       uniform_boundaries, validate, weight_grad)
from engine.pp.zero_bubble import zb_h1
from engine.grading.core import CheckFailed, Exercise, passed, run_ranks
from engine.grading.drill import Drill

HIDDEN = [(2, 4), (3, 1), (4, 2), (4, 8), (5, 7), (8, 16), (6, 3)]


def _schedules(impl):
    for p, m in HIDDEN:
        schedule = impl(p, m)
        if not isinstance(schedule, dict):
            raise CheckFailed(f"return a dict {{stage: [actions]}}, got {type(schedule).__name__}",
                              p=p, m=m)
        yield p, m, {s: [tuple(a) for a in acts] for s, acts in schedule.items()}


def check_valid_and_deadlock_free(impl):
    for p, m, schedule in _schedules(impl):
        try:
            validate(schedule)
        except ValueError as e:
            raise CheckFailed(f"validate() rejects it: {e}", p=p, m=m) from None


def check_bubble_is_the_formula(impl):
    bubbles = []
    for p, m, schedule in _schedules(impl):
        try:
            bubble = simulate(schedule, t_f=1.0, t_b=2.0).bubble
        except ValueError as e:
            raise CheckFailed(f"cannot simulate it: {e}", p=p, m=m) from None
        expected = theory.bubble_fraction(p, m)
        if abs(bubble - expected) > 1e-9:
            raise CheckFailed(f"simulated bubble {bubble:.3f}, but 1F1B keeps GPipe's "
                              f"(p-1)/(m+p-1) = {expected:.3f}: is a stage waiting when it "
                              "could run a forward?", p=p, m=m)
        bubbles.append((p, m, bubble))
    p, m, bubble = max(bubbles)  # the deepest pipeline tried
    return passed(f"simulated bubble {bubble:.3f}", "(p-1)/(m+p-1)", p=p, m=m)


def check_in_flight_at_most_p_minus_s(impl):
    for p, m, schedule in _schedules(impl):
        try:
            peaks = simulate(schedule).peak_in_flight
        except ValueError as e:
            raise CheckFailed(f"cannot simulate it: {e}", p=p, m=m) from None
        for s, peak in peaks.items():
            if peak > min(p - s, m):
                raise CheckFailed(f"stage {s} holds {peak} micro-batches at once; 1F1B holds "
                                  f"at most p - s = {p - s}: fewer warm-up forwards", p=p, m=m)


EXERCISES = [
    Exercise(
        name="ch06.one_f_one_b",
        title="The 1F1B pipeline schedule",
        module="ch06_one_f_one_b",
        attr="one_f_one_b",
        checks=(check_valid_and_deadlock_free, check_bubble_is_the_formula,
                check_in_flight_at_most_p_minus_s),
        hints=(
            "A stage can run a micro-batch's backward only after the last stage has run its "
            "forward. So stage s runs a few forwards first (the warm-up), then alternates one "
            "forward and one backward, then finishes the backwards it still owes.",
            'Return {stage: [("F", i) or ("B", i), ...]}, micro-batches in order; '
            "engine.pp.validate(schedule) names a deadlock, engine.pp.simulate(schedule) gives "
            ".bubble and each stage's .peak_in_flight: try yours before the check does.",
            "for s in range(p): warmup = min(p - s - 1, m); actions = F 0 .. warmup-1; f, b = "
            "warmup, 0; while f < m: append F f and B b; f += 1; b += 1; then append B b .. "
            "m-1.",
        ),
        blocks=("engine.pp.schedules.one_f_one_b", "engine.pp.schedules.interleaved_1f1b"),
    ),
]

DRILLS = [  # questions from engine.drill's bank: the answers are computed, not typed
    Drill("ch06.choose_m", "choose-m"),
    Drill("ch06.bubble_total", "bubble-total"),
    Drill("ch06.what_1f1b_improves", "1f1b-less-bubble"),
    Drill("ch06.zb_h2_bubble", "zb-h2-bubble"),
    Drill("ch06.zb_h2_memory", "zb-h2-memory"),
    Drill("ch06.zero_bubble_price", "zero-bubble-free"),
]


# -- ch06.interleaved -------------------------------------------------------------------------

INTERLEAVED_HIDDEN = [(2, 2, 2), (2, 4, 2), (3, 6, 2), (4, 4, 2), (4, 8, 3), (2, 6, 4),
                      (3, 3, 3), (5, 10, 2), (1, 3, 2)]


def _interleaved_schedules(impl):
    for p, m, v in INTERLEAVED_HIDDEN:
        schedule = impl(p, m, v)
        if not isinstance(schedule, dict):
            raise CheckFailed(f"return a dict {{stage: [actions]}}, got {type(schedule).__name__}",
                              p=p, m=m, v=v)
        yield p, m, v, {s: [tuple(a) for a in acts] for s, acts in schedule.items()}


def check_interleaved_valid_and_deadlock_free(impl):
    for p, m, v, schedule in _interleaved_schedules(impl):
        try:
            validate(schedule)
        except (TypeError, ValueError) as e:
            raise CheckFailed(f"validate() rejects it: {e}", p=p, m=m, v=v) from None


def check_interleaved_bubble_is_the_formula(impl):
    for p, m, v, schedule in _interleaved_schedules(impl):
        try:
            bubble = simulate(schedule, t_f=1.0, t_b=2.0).bubble
        except (TypeError, ValueError) as e:
            raise CheckFailed(f"cannot simulate it: {e}", p=p, m=m, v=v) from None
        expected = theory.bubble_fraction(p, m, v)
        if abs(bubble - expected) > 1e-9:
            raise CheckFailed(f"simulated bubble {bubble:.3f}; interleaving with v chunks makes "
                              f"it (p-1)/(v m + p - 1) = {expected:.3f}: does a stage wait when "
                              "it could run a forward?", p=p, m=m, v=v)
    p, m, v = max(INTERLEAVED_HIDDEN)
    return passed(f"simulated bubble {theory.bubble_fraction(p, m, v):.3f}",
                  "(p-1)/(v m + p - 1)", p=p, m=m, v=v)


def check_interleaved_is_megatrons_order(impl):
    for p, m, v, schedule in _interleaved_schedules(impl):
        expected = {s: [tuple(a) for a in acts] for s, acts in interleaved_1f1b(p, m, v).items()}
        for s in expected:
            got = schedule.get(s, [])
            if got != expected[s]:
                at = next((i for i, (a, b) in enumerate(zip(got, expected[s])) if a != b),
                          min(len(got), len(expected[s])))
                raise CheckFailed(
                    f"stage {s} differs from Megatron-LM's order at action {at}: got "
                    f"{got[at:at + 3]}, expected {expected[s][at:at + 3]} (warm-up forwards "
                    f"of this stage: {2 * (p - s - 1) + (v - 1) * p}, or all when m == p)",
                    p=p, m=m, v=v)


EXERCISES.append(Exercise(
    name="ch06.interleaved",
    title="The interleaved 1F1B order",
    module="ch06_interleaved",
    attr="interleaved_1f1b",
    checks=(check_interleaved_valid_and_deadlock_free, check_interleaved_bubble_is_the_formula,
            check_interleaved_is_megatrons_order),
    hints=(
        "Each rank holds v thin chunks instead of one thick stage, so the pipeline fills in "
        "1/v of the time. Micro-batches travel in groups of p: a group goes through chunk 0 "
        "of every rank, then chunk 1, ... Backwards visit the chunks in reverse. More warm-up "
        "forwards than 1F1B keep every rank busy while the first group comes back.",
        "The k-th forward of a rank is micro-batch (k // (p v)) p + k % p on chunk "
        "(k // p) % v; the k-th backward the same micro-batch on chunk v - 1 - (k // p) % v. "
        "Warm-up: min(2 (p - s - 1) + (v - 1) p, m v) forwards, all m v when m == p.",
        "for each stage s: warmup = ...; actions = [F(k) for k < warmup]; for i in "
        "range(m v - warmup): actions += [F(warmup + i), B(i)]; then B(i) for the rest; "
        "an action is (\"F\", mb, chunk).",
    ),
    blocks=("engine.pp.schedules.interleaved_1f1b",),
))


# -- ch06.linear_b_w --------------------------------------------------------------------------

LINEAR_SHAPES = [((5, 6), 4), ((2, 3, 6), 4), ((4, 1, 2, 3), 7)]  # (input shape, out)


def check_b_and_w_equal_autograd(module):
    gen = torch.Generator().manual_seed(3)
    for shape, out in LINEAR_SHAPES:
        x = torch.randn(*shape, generator=gen, requires_grad=True)
        weight = torch.randn(out, shape[-1], generator=gen, requires_grad=True)
        bias = torch.randn(out, generator=gen, requires_grad=True)
        grad_out = torch.randn(*shape[:-1], out, generator=gen)
        F.linear(x, weight, bias).backward(grad_out)
        got_x = module.linear_b(grad_out.clone(), weight.detach().clone())
        got_w = module.linear_w(x.detach().clone(), grad_out.clone())
        if not isinstance(got_w, tuple) or len(got_w) != 2:
            raise CheckFailed(f"linear_w must return (dW, db), got {type(got_w).__name__}",
                              input_shape=shape, out=out)
        for name, got, expected in (("linear_b's dX", got_x, x.grad),
                                    ("linear_w's dW", got_w[0], weight.grad),
                                    ("linear_w's db", got_w[1], bias.grad)):
            if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
                raise CheckFailed(f"{name} has shape {getattr(got, 'shape', got)}, autograd's "
                                  f"{tuple(expected.shape)}", input_shape=shape, out=out)
            if not torch.allclose(got, expected, rtol=1e-5, atol=1e-5):
                raise CheckFailed(f"{name} differs from autograd's (largest difference "
                                  f"{(got - expected).abs().max().item():.2e}): dX = dY W, "
                                  "dW = dYᵀ X and db = Σ dY, summed over every leading index",
                                  input_shape=shape, out=out)


ZB_WIDTHS, ZB_MICRO_BATCHES = (8, 16, 16, 16, 8), 4


def _zb_model() -> nn.Sequential:
    with seeded(5):
        layers = []
        for a, b in zip(ZB_WIDTHS[:-1], ZB_WIDTHS[1:]):
            layers += [nn.Linear(a, b), nn.Tanh()]
        return nn.Sequential(*layers[:-1])


def _zb_micro_batches():
    gen = torch.Generator().manual_seed(9)
    xs = [torch.randn(2, 3, ZB_WIDTHS[0], generator=gen) for _ in range(ZB_MICRO_BATCHES)]
    ys = [torch.randn(2, 3, ZB_WIDTHS[-1], generator=gen) for _ in range(ZB_MICRO_BATCHES)]
    return xs, ys


def _clone_grad(t: torch.Tensor):
    return None if t.grad is None else t.grad.detach().clone()


def _zero_bubble_on_rank(rank, world_size, module):
    """A driver (runs where the learner's code does): ZB-H1 on this rank's stage with the
    learner's B and W in the runtime. It returns what it saw: each B call's weight gradient
    before and after it, the stage's gradients, the order of the actions. The check compares
    them, in the grader, with one process's gradients."""
    xs, ys = _zb_micro_batches()
    model = _zb_model()
    mine = split_model(model, uniform_boundaries(len(model), world_size))[rank]
    b_calls = []  # (the weight's shape, its .grad before linear_b, its .grad after)
    engines = weight_grad.linear_input_grad, weight_grad.linear_weight_grad

    def set_halves(b, w):  # the runtime calls B and W by these module names
        weight_grad.linear_input_grad, weight_grad.linear_weight_grad = b, w

    def graded_b(grad_out, weight):  # the learner's B, watched: it must leave .grad alone
        before = _clone_grad(weight)
        set_halves(*engines)  # while the learner's code runs, the names are the engine's
        try:
            grad_x = module.linear_b(grad_out, weight)
        finally:
            set_halves(graded_b, graded_w)
        b_calls.append((tuple(weight.shape), before, _clone_grad(weight)))
        return grad_x

    def graded_w(x, grad_out):
        set_halves(*engines)
        try:
            return module.linear_w(x, grad_out)
        finally:
            set_halves(graded_b, graded_w)

    set_halves(graded_b, graded_w)
    try:
        run = run_pipeline([mine], zb_h1(world_size, ZB_MICRO_BATCHES), xs, ys, stage=rank)
    finally:
        set_halves(*engines)
    return dict(b_calls=b_calls,
                grads=[(name, _clone_grad(p)) for name, p in mine.named_parameters()],
                order=[(e.args["kind"], e.args["mb"]) for e in run.events])


def _one_process_grads(world_size: int) -> list[list[torch.Tensor]]:
    """Each stage's parameters' gradients after one process ran every micro-batch: the
    reference, computed in the grader."""
    xs, ys = _zb_micro_batches()
    reference = _zb_model()
    (sum(F.mse_loss(reference(x), y) for x, y in zip(xs, ys)) / ZB_MICRO_BATCHES).backward()
    stages = split_model(reference, uniform_boundaries(len(reference), world_size))
    return [[p.grad for p in stage.parameters()] for stage in stages]


def check_zero_bubble_runtime_w_after_b(module):
    expected = _one_process_grads(2)
    for rank, res in enumerate(run_ranks(_zero_bubble_on_rank, 2, module, timeout=30)):
        touched = [shape for shape, before, after in res["b_calls"]
                   if (before is None) != (after is None)
                   or (before is not None and not torch.equal(before, after))]
        if touched:
            raise CheckFailed(f"rank {rank}: the .grad of the weight(s) of shape {touched} "
                              "changed while linear_b ran: B computes only dX; the weight "
                              "gradient is W's, later", world_size=2, schedule="zb_h1",
                              m=ZB_MICRO_BATCHES)
        differ = [name for (name, got), want in zip(res["grads"], expected[rank], strict=True)
                  if got is None or not torch.allclose(got, want, atol=1e-6)]
        if differ:
            raise CheckFailed(f"rank {rank}: after ZB-H1 the gradients of {differ} differ "
                              "from one process: in the runtime the inputs are 3-D "
                              "(batch, tokens, features)", world_size=2, schedule="zb_h1",
                              m=ZB_MICRO_BATCHES)
        early = [w for w in res["order"] if w[0] == "W"
                 and res["order"].index(("B", w[1])) > res["order"].index(w)]
        if early:  # the runtime follows the schedule; this guards the schedule it was given
            raise CheckFailed(f"rank {rank}: W of micro-batch {early[0][1]} ran before its B",
                              world_size=2, schedule="zb_h1")
    order = " ".join(f"{kind}{mb}" for kind, mb in res["order"])
    return passed(f"stage 1 ran {order}: each W after its B", "ZB-H1's order, gradients "
                  "equal to one process", p=2, m=ZB_MICRO_BATCHES)


EXERCISES.append(Exercise(
    name="ch06.linear_b_w",
    title="A linear layer's backward split into B and W",
    module="ch06_linear_b_w",
    attr="",
    checks=(check_b_and_w_equal_autograd, check_zero_bubble_runtime_w_after_b),
    hints=(
        "Y = X Wᵀ + b. The input's gradient needs only dY and W; the weights' gradients need "
        "only X and dY. So B can run as soon as dY arrives, and W any time later, if X and dY "
        "are kept. Every row of the micro-batch (every leading index) adds to dW and db.",
        "torch.matmul broadcasts over leading dimensions; t.reshape(-1, t.shape[-1]) turns "
        "[..., k] into rows; .t() transposes a 2-D tensor; .sum(dim=0) adds the rows.",
        "linear_b: return grad_out @ weight. linear_w: dy = grad_out.reshape(-1, out); "
        "xs = x.reshape(-1, in); return dy.t() @ xs, dy.sum(0)",
    ),
    blocks=("engine.pp.weight_grad.linear_input_grad",
            "engine.pp.weight_grad.linear_weight_grad"),
))
