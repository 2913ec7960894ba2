"""MoE at inference: redundant experts (engine.moe.redundant) conserve tokens and never raise
the busiest GPU's load; with a capacity, a token's output depends on its batch, dropless it
does not (engine.labs.moe_serving)."""

import random

import pytest

from engine.moe.redundant import (imbalance_floor, place_experts, redundancy_table,
                                  static_placement)
from engine.labs.moe_serving import batching_experiment


def _random_loads(rng, experts):
    return [int(rng.paretovariate(1.2) * 50) for _ in range(experts)]


def test_placement_hand_counted():
    # LPT: e0 (10) -> GPU0, e1 (2) -> GPU1, e2 (2) -> GPU1, e3 (2) -> GPU0: loads 12, 4.
    # One copy of e0 on GPU1 takes (12 - 4) // 2 = 4 of its tokens: 8, 8.
    assert place_experts([10, 2, 2, 2], 2, 3, 0).loads == [12, 4]
    placed = place_experts([10, 2, 2, 2], 2, 3, 1)
    assert placed.loads == [8, 8]
    assert placed.copies[1][-1] == (0, 4)
    assert static_placement([10, 2, 2, 2], 2).loads == [12, 4]


def test_placement_conserves_tokens_and_never_raises_the_max():
    rng = random.Random(0)
    complete = 0
    for _ in range(200):
        gpus = rng.choice([2, 3, 4, 8])
        experts = gpus * rng.choice([1, 2, 4])
        spare = rng.choice([1, 2])
        load = _random_loads(rng, experts)
        previous = None
        for r in range(gpus * spare + 1):
            try:
                placed = place_experts(load, gpus, experts // gpus + spare, r)
            except ValueError as refused:  # every free slot's GPU holds that expert already
                assert "no GPU has a free slot" in str(refused)
                break
            assert placed.expert_tokens(experts) == load
            assert sum(placed.loads) == sum(load)
            assert all(len(gpu) <= experts // gpus + spare for gpu in placed.copies)
            assert all(len({e for e, _ in gpu}) == len(gpu) for gpu in placed.copies)
            assert sum(len(gpu) for gpu in placed.copies) == experts + r
            if previous is not None:
                assert max(placed.loads) <= previous
            previous = max(placed.loads)
        else:
            complete += 1
    assert complete >= 150  # most cases fill every spare slot


def test_redundancy_helps_a_skewed_router():
    load = [2812, 1652, 1048, 684, 495, 342, 254, 184, 174, 125, 109, 85, 80, 55, 59, 34]
    rows = redundancy_table(load, 4)
    imbalance = [row["imbalance"] for row in rows]
    assert [row["redundant"] for row in rows] == ["static", 0, 1, 2, 4]
    assert imbalance[0] > imbalance[1] > imbalance[2] >= imbalance[3] > imbalance[4]
    assert imbalance[4] < 1.05  # four copies: the hottest expert no longer dominates a GPU


def test_the_hottest_expert_bounds_every_placement():
    assert imbalance_floor(0.3, 16) == pytest.approx(4.8)
    assert imbalance_floor(0.15, 8, 2) == 1.0
    rng = random.Random(1)
    for _ in range(50):
        load = _random_loads(rng, 16)
        share = max(load) / sum(load)
        assert place_experts(load, 4, 4).imbalance >= imbalance_floor(share, 4) - 1e-12
        assert static_placement(load, 4).imbalance >= imbalance_floor(share, 4) - 1e-12


def test_placement_refuses_too_many_copies():
    with pytest.raises(ValueError, match="do not fit"):
        place_experts([1, 2, 3, 4], 2, 2, 1)


def test_capacity_makes_outputs_depend_on_the_batch_dropless_does_not():
    capped = batching_experiment(1.0)
    assert capped["dropped_alone"] > 0
    assert capped["size"] > 0 and capped["company"] > 0
    dropless = batching_experiment(None)
    # float64: the same expert weights on the same row; only the batch around it differs
    assert dropless == dict(size=0, company=0, dropped_alone=0)
