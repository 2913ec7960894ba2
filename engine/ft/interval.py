"""The checkpoint interval against the failure rate, on a simulated clock.

A job needs ``work_s`` seconds of compute. Every ``interval_s`` of compute it writes a
checkpoint that costs ``checkpoint_s``; failures arrive at exponential inter-arrival times of
mean ``mtbf_s`` (a Poisson process on the wall clock, checkpoints and restarts included); each
one loses the compute since the last complete checkpoint and costs ``restart_s`` to come back.
:func:`simulate_wall_time` plays this out with a seeded RNG (real failures are too slow to
wait for); :func:`best_interval` scans intervals and returns the one with the least mean wall
time, to set beside Young's ``sqrt(2·C·M)`` (:func:`engine.theory.young_checkpoint_interval`).
"""

from __future__ import annotations

import random

from engine.validation import non_negative_number, positive_int, positive_number


def simulate_wall_time(interval_s: float, checkpoint_s: float, mtbf_s: float, work_s: float,
                       restart_s: float = 0.0, seed: int = 0) -> float:
    """Wall seconds to finish ``work_s`` of compute under failures (see the module)."""
    for name, value in (("interval_s", interval_s), ("mtbf_s", mtbf_s), ("work_s", work_s)):
        positive_number(name, value)
    non_negative_number("checkpoint_s", checkpoint_s)
    non_negative_number("restart_s", restart_s)
    rng = random.Random(seed)
    clock, saved = 0.0, 0.0
    next_failure = rng.expovariate(1 / mtbf_s)
    while saved < work_s:
        segment = min(interval_s, work_s - saved)
        cost = segment + (checkpoint_s if saved + segment < work_s else 0.0)
        if clock + cost <= next_failure:  # the segment and its checkpoint complete
            clock += cost
            saved += segment
            continue
        clock = next_failure + restart_s  # lost: back to the last checkpoint
        next_failure = clock + rng.expovariate(1 / mtbf_s)
    return clock


def best_interval(intervals, checkpoint_s: float, mtbf_s: float, work_s: float,
                  restart_s: float = 0.0, trials: int = 20) -> tuple[float, dict]:
    """The interval of ``intervals`` with the least mean wall time over ``trials`` seeds (the
    same seeds for every interval), and every interval's mean."""
    positive_int("trials", trials)
    means = {t: sum(simulate_wall_time(t, checkpoint_s, mtbf_s, work_s, restart_s, seed)
                    for seed in range(trials)) / trials for t in intervals}
    return min(means, key=means.get), means
