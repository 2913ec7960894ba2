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
    from engine.observe.trace import TraceEvent
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


def test_zero_memory_figure_and_explorer():
    import pytest

    from engine import theory
    from engine.viz.zero import memory_explorer, memory_figure, per_gpu_bytes

    parts = per_gpu_bytes("LLaMA 7B", 8, 3, checkpoint=True)
    expected = theory.zero_model_state_bytes(6.7e9, 8, 3)
    assert parts["params"] + parts["grads"] + parts["optimizer"] == expected["total"]
    assert parts["activations"] == 32 * 2 * 2048 * 4096  # 2sbh per layer, checkpointed
    assert per_gpu_bytes("LLaMA 7B", 8, 1, offload=True)["optimizer"] == 0
    assert memory_figure("GPT-3 175B", 64, 3).axes[0].get_yscale() == "log"
    assert memory_explorer() is not None
    with pytest.raises(ValueError, match="unknown preset 'GPT-5'"):
        per_gpu_bytes("GPT-5", 8, 1)


def test_activation_formula_is_korthikanti_equation_two():
    from engine import theory

    # GPT-3 175B, s=2048, b=1: sbh(34 + 5as/h) = 2048*12288*(34 + 80) bytes per layer
    per_layer = 2048 * 12288 * 114
    assert theory.transformer_activation_bytes(96, 12288, 96, 2048) == 96 * per_layer
    assert theory.transformer_activation_bytes(96, 12288, 96, 2048, checkpoint=True) == \
        96 * 2 * 2048 * 12288


def test_tp_split_figure_draws_both_splits():
    from engine.viz.tp import split_figure

    fig = split_figure(4)
    titles = [ax.get_title() for ax in fig.axes]
    assert any("Column-parallel" in t for t in titles) and any("Row-parallel" in t for t in titles)
    assert len(fig.axes[0].patches) == 1 + 4 + 4  # X whole, W and Y in four slices


def test_pipeline_gantt_and_explorer():
    from engine.pp import interleaved_1f1b, simulate
    from engine.observe.trace import TraceEvent
    from engine.viz.pipeline import gantt_figure, pipeline_explorer, timeline_rows

    result = simulate(interleaved_1f1b(2, 4, 2))
    fig = gantt_figure(result.timeline, "t")
    assert len(fig.axes[0].patches) == len(result.timeline) == 2 * 2 * 4 * 2
    events = [TraceEvent("F0", 1, 0.0, 1.0, args={"kind": "F", "mb": 0, "chunk": 0})]
    assert timeline_rows(events) == [(1, "F", 0, 0, 0.0, 1.0)]
    assert pipeline_explorer() is not None


def test_planner_table_figure_and_explorer():
    from engine.theory.planner import MODELS, Cluster, plan
    from engine.viz.planner import planner_explorer, plans_figure, plans_table

    plans = plan(MODELS["GPT-3 175B"], Cluster(1024), 1536)
    table = plans_table(plans, top=3)
    assert table.count("\n") == 3 and "dp" in table
    fig = plans_figure(plans, 80, top=4)
    assert len(fig.axes[0].get_yticklabels()) == 4
    assert planner_explorer() is not None


def test_drill_widget_checks_an_answer_and_saves_the_score(tmp_path):
    import html
    import json

    from engine.drill import draw
    from engine.viz.drill import drill_widget

    path = tmp_path / "drill.json"
    box = drill_widget(count=2, seed=5, scores_path=path)
    body, answer, buttons, result = box.children
    check, nxt = buttons.children
    q = draw(2, seed=5)[0]
    if q.kind == "outline":  # "Show outline": the outline comes once the learner has answered
        assert q.outline[0] not in body.value
        check.click()
        assert q.outline[0] in html.unescape(body.value)
    answer.value = str(q.answer) if q.kind == "numeric" else (
        chr(97 + q.answer) if q.kind == "choice" else "y")
    check.click()
    assert "right" in result.value
    assert sum(e["right"] for e in json.loads(path.read_text()).values()) == 1
    nxt.click()
    nxt.click()
    assert "Done: 1/2" in body.value
