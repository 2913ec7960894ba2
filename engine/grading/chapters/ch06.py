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
        hint="warmup = min(p - s - 1, m) forwards; then while forwards remain: F(next), "
             "B(oldest); then the remaining backwards.",
    ),
]

DRILLS = [
    Drill("ch06.choose_m",
          "8 pipeline stages: the smallest number of micro-batches m that keeps the bubble "
          "under 10% of the ideal compute time?", 71,
          "(p-1)/m < 0.1 needs m > 10(p-1) = 70, so 71. 'm >= 10p' (80) is more than needed, "
          "and the same target relative to total time, (p-1)/(m+p-1) < 0.1, needs m > 63."),
    Drill("ch06.bubble_total",
          "GPipe or 1F1B with 4 stages and 12 micro-batches: what fraction of the total time "
          "is bubble?", 0.2,
          "(p-1)/(m+p-1) = 3/15 = 0.2. 1F1B has the same bubble as GPipe; it only caps the "
          "activations in flight at p."),
]
