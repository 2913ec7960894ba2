"""The memory table of chapter 06 measured on real ranks, on transformer blocks: each
schedule's peak on its busiest rank equals its formula in units of one micro-batch's
activations (1F1B, ZB-H1 and ZB-V: p; ZB-H2: 2p-1; DualPipeV: p + 1/2), because a
transformer block's W-stash is smaller than its activations; the V schedules send twice the
point-to-point messages."""

from __future__ import annotations

import pytest

from engine import theory
from engine.labs.pipeline_memory import NAMES, memory_rank, memory_rows
from tests.helpers import run_ranks


def test_measured_peak_per_rank_is_the_formula_and_v_schedules_send_twice_the_messages():
    p, m = 2, 4
    rows = {row["schedule"]: row for row in memory_rows(run_ranks(memory_rank, p, m), m)}
    assert list(rows) == list(NAMES)
    for name, row in rows.items():
        assert max(row["measured"]) == pytest.approx(row["formula"], rel=1e-12), name
        assert row["hops"] == row["hops_formula"] == theory.pipeline_p2p_hops(name, p)
        split = name != "1f1b"
        assert all(0 < r < 1 for r in row["stash_over_activations"]) if split else \
            row["stash_over_activations"] == [0.0] * p
    assert rows["zb_h2"]["measured"][0] == pytest.approx(2 * p - 1, rel=1e-12)
    assert rows["zb_h1"]["measured"][0] == pytest.approx(rows["1f1b"]["measured"][0])
    assert rows["zb_v"]["hops"] == 2 * rows["1f1b"]["hops"] == 4 * (p - 1)
    assert rows["dualpipe_v"]["held"] == [p + 0.5] * p  # 2p+1 half-stage chunks


def test_the_formulas_name_their_schedule_and_refuse_others():
    assert [theory.pipeline_peak_activations(n, 4) for n in NAMES] == [4, 4, 7, 4, 4.5]
    assert [theory.pipeline_p2p_hops(n, 4) for n in NAMES] == [6, 6, 6, 12, 12]
    with pytest.raises(ValueError, match="schedule"):
        theory.pipeline_peak_activations("zb_h3", 4)
