"""Checks for chapter 06: a 1F1B schedule generator; drills on choosing m."""

from __future__ import annotations

from engine import theory
from engine.pp import simulate, validate
from engine.grading.core import CheckFailed, Exercise, passed
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
            'Return {stage: [("F", i) or ("B", i), ...]}; stage s warms up with min(p - s - 1, '
            "m) forwards; engine.pp.validate(schedule) and engine.pp.simulate(schedule) "
            "(.bubble, .peak_in_flight) try it out.",
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
]
