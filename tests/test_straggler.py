"""The straggler detector (engine.ft.straggler): a rank slowed 2x is named within 10 steps; no rank
is named in 500 healthy steps with realistic jitter."""

from __future__ import annotations

import random

import pytest

from engine.observe.nccl_rules import nccl_rules
from engine.ft.straggler import StragglerDetector, gather_step_times
from tests.helpers import run_ranks

RANKS = 8


def _healthy_times(rng, ranks=RANKS, base=0.25):
    """One step's times: a per-step shared level (the step's work varies), each rank's own
    log-normal jitter (5%), and a rare spike (1% of rank-steps: 1.2x to 3x: a GC, a page
    fault, a noisy neighbour)."""
    level = base * rng.lognormvariate(0, 0.03)
    times = []
    for _ in range(ranks):
        t = level * rng.lognormvariate(0, 0.05)
        if rng.random() < 0.01:
            t *= rng.uniform(1.2, 3.0)
        times.append(t)
    return times


@pytest.mark.parametrize("seed", range(3))
def test_no_rank_is_named_in_500_healthy_steps(seed):
    rng = random.Random(seed)
    detector = StragglerDetector(RANKS)
    for _ in range(500):
        detector.observe(_healthy_times(rng))
    assert detector.named == {}


@pytest.mark.parametrize("seed", range(3))
def test_a_rank_slowed_2x_is_named_within_10_steps(seed):
    rng = random.Random(seed)
    detector = StragglerDetector(RANKS)
    for _ in range(50):  # healthy first
        detector.observe(_healthy_times(rng))
    for step in range(1, 11):
        times = _healthy_times(rng)
        times[5] *= 2.0
        if detector.observe(times):
            break
    assert detector.named == {5: detector.steps}
    assert detector.steps - 50 <= 10


def _gathered(rank, world_size, steps):
    detector = StragglerDetector(world_size)
    rng = random.Random(rank)
    with nccl_rules():  # NCCL's rules on Gloo: every tensor gathered on the rank's device
        for _ in range(steps):
            seconds = 0.1 * rng.lognormvariate(0, 0.05) * (2.0 if rank == 1 else 1.0)
            detector.observe(gather_step_times(seconds))
    return detector.named


def test_every_rank_gathers_the_same_times_and_names_the_same_rank():
    named = run_ranks(_gathered, 3, 10)
    assert named == [{1: 3}] * 3


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="ratio"):
        StragglerDetector(4, ratio=0.9)
    with pytest.raises(ValueError, match="expected 4 step times, got 3"):
        StragglerDetector(4).observe([1, 1, 1])
