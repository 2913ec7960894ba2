"""The optimizer step without a synchronisation across pipeline stages: steps back to back,
and the global check moved after the step (Qi et al., "Zero Bubble Pipeline Parallelism",
ICLR 2024, section 4, "Bypassing optimizer synchronizations").

Most training loops check the gradients globally before the optimizer step: the gradient
norm summed over every stage (for clipping) and a NaN/inf test (for a loss scaler). Both are
an all-reduce over the pipeline ranks, so every stage waits for the last one to finish its
backward before stepping, and the next step starts together on all stages. ZB-H2's step is a
parallelogram (:func:`engine.pp.zero_bubble.zb_h2`): stage 0 finishes first and stage
``p-1`` last, so that wait is a bubble of its own. The paper steps each stage as soon as its
own gradients are ready, as if the check will pass: the state reduced so far travels from
stage to stage with the step (a stage may already skip a step the partial state condemns),
the fully reduced state comes back during the next step's warm-up, and when the global check
fails (the norm above the clipping threshold, or a NaN/inf) the step is rolled back and redone
with the global state (clipped, or skipped). In stable training the check rarely fails.

* :func:`back_to_back`: ``steps`` copies of a schedule, each stage starting the next step as
  soon as it has finished its own part of the last one (no synchronisation);
* :func:`own_span_idle`: the idle time of each stage inside its own part of a step;
* :func:`step_times`: the time per step with a synchronising check before each step (the
  whole step plus the all-reduce) and with post-validation (steps back to back), simulated;
* :func:`step_then_validate`: the eager step, the global check after, and the rollback, on
  stages given as ``(parameters, optimizer)`` pairs (one process, the global check only, no
  early skip; on ranks the sum of squared norms is one reduction of one number).
"""

from __future__ import annotations

import copy
import math

import torch

from engine.pp.actions import Action, actions_of, shape
from engine.pp.schedules import simulate
from engine.validation import non_negative_number, positive_int


def back_to_back(schedule, steps: int) -> dict[int, list[Action]]:
    """``steps`` training steps of ``schedule`` as one schedule: step ``k``'s micro-batch
    ``mb`` is ``k * m + mb``, and every stage runs its steps in order with nothing between
    them, as when the optimizer step waits for no other stage."""
    positive_int("steps", steps)
    schedule = actions_of(schedule)
    _, m, _ = shape(schedule)
    return {s: [Action(a.kind, k * m + a.mb, a.chunk) for k in range(steps) for a in acts]
            for s, acts in schedule.items()}


def step_times(schedule, *, t_sync: float = 0.0, placement: str = "interleaved",
               steps: int = 4, **times) -> dict[str, float]:
    """Simulated time per training step of ``schedule`` (``times``: ``t_f``, ``t_b``,
    ``t_w``, ``t_comm`` as :func:`engine.pp.simulate` takes them):

    * ``"synchronised"``: the global check before the optimizer step; every stage waits for
      the whole step to end, then for the all-reduce (``t_sync``), and all start the next
      step together: one step's span plus ``t_sync``;
    * ``"post_validated"``: the check after the step, overlapped with the next one: steps back
      to back, the time one more step adds in steady state (step ``steps`` minus step
      ``steps - 1``);
    * ``"busy"``: the compute of one stage per step, the time with no bubble at all."""
    non_negative_number("t_sync", t_sync)
    positive_int("steps", steps)
    if steps < 2:
        raise ValueError(f"steps must be at least 2 to measure a steady step, got {steps}")
    one = simulate(schedule, placement=placement, **times)
    last = simulate(back_to_back(schedule, steps), placement=placement, **times).total
    before = simulate(back_to_back(schedule, steps - 1), placement=placement, **times).total
    busy = max(one.total - idle for idle in one.idle().values())
    return {"synchronised": one.total + t_sync, "post_validated": last - before, "busy": busy}


def own_span_idle(result) -> dict[int, float]:
    """Idle time of each stage of a simulated step (:class:`engine.pp.SimResult`) between its
    own first start and last end: what the stage waits for inside its part of the step,
    leaving out the start and end it cannot move (a parallelogram's slanted sides)."""
    spans: dict[int, list[float]] = {}
    for stage, _, _, _, start, end in result.timeline:
        span = spans.setdefault(stage, [start, end, 0.0])
        span[0], span[1], span[2] = min(span[0], start), max(span[1], end), span[2] + end - start
    return {s: last - first - busy for s, (first, last, busy) in sorted(spans.items())}


def _global_norm(stages) -> float:
    squares = [p.grad.detach().double().pow(2).sum() for params, _ in stages for p in params
               if p.grad is not None]
    return math.sqrt(float(sum(squares))) if squares else 0.0


def step_then_validate(stages, max_norm: float) -> dict:
    """One optimizer step of every stage, post-validated. ``stages``: ``[(parameters,
    optimizer), ...]``, one per pipeline stage. Each stage keeps a copy of its parameters and
    optimizer state (the simplest way to roll back), steps at once with its own gradients,
    and only then is the global gradient norm computed (on ranks: one all-reduce of the
    squared norms). If it is NaN or inf, every stage rolls back and the step is skipped; if
    it is above ``max_norm``, every stage rolls back and steps again with its gradients
    scaled by ``max_norm / norm`` (what ``clip_grad_norm_`` before the step would have done).
    Returns ``{"norm", "outcome"}``, the outcome ``"kept"``, ``"clipped"`` or ``"skipped"``."""
    non_negative_number("max_norm", max_norm)
    stages = [(list(params), opt) for params, opt in stages]
    saved = [([p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()))
             for params, opt in stages]
    for _, opt in stages:  # eager: as if the check will pass
        opt.step()
    norm = _global_norm(stages)  # after the step, overlapped with the next one on a GPU
    if math.isfinite(norm) and norm <= max_norm:
        return {"norm": norm, "outcome": "kept"}
    for (params, opt), (values, state) in zip(stages, saved):  # roll back
        with torch.no_grad():
            for p, value in zip(params, values):
                p.copy_(value)
        opt.load_state_dict(state)
    if not math.isfinite(norm):
        return {"norm": norm, "outcome": "skipped"}
    for params, opt in stages:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(max_norm / (norm + 1e-6))  # clip_grad_norm_'s scale
        opt.step()
    return {"norm": norm, "outcome": "clipped"}
