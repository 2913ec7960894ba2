"""Figures: the ring stepper replays the engine's schedule; every figure draws without error."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from engine.comm.ring import chunk_sizes  # noqa: E402
from engine.viz import all_reduce_figure, bytes_per_rank_figure  # noqa: E402
from engine.viz.collectives import collectives_figure, ps_vs_ring_figure  # noqa: E402
from engine.viz.ring import ring_states, ring_step_figure, sent_chunk  # noqa: E402


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_ring_states_follow_the_engines_schedule(n):
    states = ring_states(n)
    everyone = frozenset(range(n))
    assert len(states) == 2 * (n - 1) + 1
    after_rs = states[n - 1]
    assert all(after_rs[r][r] == everyone for r in range(n))  # rank r owns chunk r, as ring.py
    assert all(cell == everyone for row in states[-1] for cell in row)
    first_sends = [sent_chunk(n, 0, r) for r in range(n)]
    assert first_sends == ([(r - 1) % n for r in range(n)] if n > 1 else [None])
    assert len(chunk_sizes(10, n)) == n


def test_every_figure_draws_and_labels_its_axes():
    figures = [ring_step_figure(4, 3), collectives_figure(), ps_vs_ring_figure(8, 100),
               all_reduce_figure(100, 8), bytes_per_rank_figure([1, 2], [1, 2], "t")]
    for fig in figures:
        assert fig.axes and fig.axes[0].get_title()
        fig.canvas.draw()
        plt.close(fig)
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        ring_states(0)


def test_timeline_draws_lanes_and_rejects_nothing():
    from engine.trace import TraceEvent
    from engine.viz.timeline import timeline_figure

    events = [TraceEvent("backward", 0, 0.0, 0.01, lane="compute"),
              TraceEvent("all_reduce", 0, 0.004, 0.012, lane="comm"),
              TraceEvent("backward", 1, 0.0, 0.011, lane="compute")]
    fig = timeline_figure(events, "t")
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == [
        "rank 1: compute", "rank 0: comm", "rank 0: compute"]
    plt.close(fig)
    with pytest.raises(ValueError, match="no events to draw"):
        timeline_figure([])
