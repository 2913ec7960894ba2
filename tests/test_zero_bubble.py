"""Zero-bubble pipelines: the backward split into B (input gradient) and W (weight gradient).
Schedules as data (complete and deadlock-free), the ZB-H1 bubble formula checked exactly by
the simulator, the orders checked against torch.distributed.pipelining's, and the runtime's
gradients and training equal to one process."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from engine import theory
from engine.pp import (Action, one_f_one_b, rank_of, simulate, validate, virtual_stage,
                       virtual_stages)
from engine.pp.reference import torch_order
from engine.pp.zero_bubble import dualpipe_v, zb_h1, zb_v
from tests.helpers import run_ranks
from tests.test_pp import _train  # the runtime against one process, any schedule

SCHEDULES = {"zb_h1": (zb_h1, "interleaved"), "zb_v": (zb_v, "v"),
             "dualpipe_v": (dualpipe_v, "v")}


def _grid(name):
    low = 2 if name == "dualpipe_v" else 0  # DualPipeV needs m >= 2p
    return [(p, m) for p in (1, 2, 3, 4, 6) for m in range(max(1, low * p), 3 * p + 2)]


# -- schedules as data ----------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_micro_batch_gets_f_b_and_w_once_per_chunk_w_after_b(name):
    make, placement = SCHEDULES[name]
    for p, m in _grid(name):
        schedule = make(p, m)
        validate(schedule, placement=placement)  # complete and deadlock-free
        v = 1 if name == "zb_h1" else 2
        for stage, actions in schedule.items():  # counted again here, independently
            assert Counter(actions) == Counter(Action(k, mb, c) for k in "FBW"
                                               for mb in range(m) for c in range(v))
            for a in actions:
                if a.kind == "W":
                    assert actions.index(Action("B", a.mb, a.chunk)) < actions.index(a)


def test_v_placement_puts_the_first_and_last_stage_on_rank_0():
    for p in (1, 2, 4, 8):
        assert virtual_stages(0, p, 2, "v") == [0, 2 * p - 1]
        assert virtual_stages(p - 1, p, 2, "v") == [p - 1, p]  # the turn of the V, one rank
        assert virtual_stages(0, p, 2) == [0, p]  # interleaved, for contrast
        for stage, chunk in itertools.product(range(p), range(4)):
            for placement in ("v", "interleaved"):
                assert rank_of(virtual_stage(stage, chunk, p, placement), p, placement) == stage


def test_a_v_schedule_read_as_interleaved_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="deadlock.*it runs with placement='v'"):
        validate(zb_v(4, 8))
    with pytest.raises(ValueError, match="placement must be one of 'interleaved', 'v'"):
        validate(zb_v(4, 8), placement="w")


@pytest.mark.parametrize("bad, message", [
    ({0: [("F", 0), ("W", 0), ("B", 0)]}, "stage 0 runs \\('W', 0\\) before its B"),
    ({0: [("F", 0), ("B", 0), ("W", 0), ("F", 1), ("B", 1)]},
     "stage 0 must run F, B and W of every micro-batch once: missing \\[W1\\]"),
    ({0: [("F", 0), ("B", 0), ("W", 0), ("W", 0)]}, "repeated or unknown \\[W0\\]"),
])
def test_validate_names_a_misplaced_or_missing_w(bad, message):
    with pytest.raises(ValueError, match=message):
        validate(bad)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="DualPipeV needs m \\(micro-batches\\) >= 2p = 8, "
                                         "got m=7"):
        dualpipe_v(4, 7)
    with pytest.raises(ValueError, match="p \\(stages\\) must be a positive int, got 0"):
        zb_v(0, 4)
    with pytest.raises(ValueError, match="t_w must be a number >= 0, got -1"):
        simulate(zb_h1(2, 4), t_w=-1)
    with pytest.raises(TypeError):  # times are keywords
        simulate(zb_h1(2, 4), 1.0, 2.0)
    with pytest.raises(ValueError, match="the ZB-H1 formula holds for T_W <= T_F"):
        theory.zb_h1_bubble_time(4, t_f=1, t_b=2, t_w=1.5)


# -- the simulator and the formulas ---------------------------------------------------------

TIMES = [(t_f, t_b, t_w) for t_f, t_b, t_w in itertools.product((1, 1.5, 2, 3), (1, 2, 3),
                                                                  (0.25, 0.5, 1, 2, 3))
         if t_w <= min(t_f, t_b)]


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_zb_h1_bubble_is_the_papers_formula(p):
    for m in range(p, 3 * p + 1):
        for t_f, t_b, t_w in TIMES:
            result = simulate(zb_h1(p, m), t_f=t_f, t_b=t_b, t_w=t_w)
            idle = (p - 1) * (t_f + t_b - t_w)  # Qi et al. 2024, section 3.1
            assert result.total == pytest.approx(m * (t_f + t_b + t_w) + idle, abs=1e-12)
            assert result.bubble == pytest.approx(
                theory.zb_h1_bubble_fraction(p, m, t_f, t_b, t_w), abs=1e-12)
            assert all(x == pytest.approx(idle, abs=1e-12) for x in result.idle().values())


@pytest.mark.parametrize("p", [2, 4, 8])
def test_with_fewer_micro_batches_than_stages_zb_h1_idles_at_least_the_formula(p):
    for m in range(1, p):
        for t_f, t_b, t_w in TIMES:
            bubble = simulate(zb_h1(p, m), t_f=t_f, t_b=t_b, t_w=t_w).bubble
            assert bubble >= theory.zb_h1_bubble_fraction(p, m, t_f, t_b, t_w) - 1e-12


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 12), (8, 16)])
def test_one_f_one_b_idles_p_minus_1_full_forward_backward_slots(p, m):
    for t_f, t_b, t_w in TIMES:
        idle = simulate(one_f_one_b(p, m), t_f=t_f, t_b=t_b, t_w=t_w).idle()
        assert all(x == pytest.approx(theory.one_f_one_b_bubble_time(p, t_f, t_b, t_w))
                   for x in idle.values())


def test_the_two_published_zb_h1_formulas_differ_only_in_what_b_means():
    # the paper: (p-1)(F + B - W), B the input gradient; the DualPipe README:
    # (PP-1)(F + B - 2W), B the full backward = input gradient + W
    for p, (t_f, t_b, t_w) in itertools.product((2, 4, 8), TIMES):
        paper = theory.zb_h1_bubble_time(p, t_f, t_b, t_w, b="input")
        readme = theory.zb_h1_bubble_time(p, t_f, t_b + t_w, t_w, b="full")
        assert paper == pytest.approx(readme) == pytest.approx((p - 1) * (t_f + t_b - t_w))
        assert readme == pytest.approx((p - 1) * (t_f + (t_b + t_w) - 2 * t_w))


@pytest.mark.parametrize("p, m", [(2, 4), (4, 4), (4, 8), (3, 10), (8, 16)])
def test_zb_h1_holds_1f1bs_activations_and_every_stage_p_micro_batches_until_w(p, m):
    ours = simulate(zb_h1(p, m), t_f=1, t_b=1, t_w=1)
    assert ours.peak_in_flight == simulate(one_f_one_b(p, m)).peak_in_flight
    assert ours.peak_in_flight == {s: min(p - s, m) for s in range(p)}
    assert ours.peak_held == {s: min(p, m) for s in range(p)}  # stage 0's count under 1F1B


# -- ground truth: torch.distributed.pipelining's orders --------------------------------------


@pytest.mark.parametrize("name", ["zb_v", "dualpipe_v"])
def test_zb_v_and_dualpipe_v_orders_equal_pytorchs(name):
    make, _ = SCHEDULES[name]
    for p, m in _grid(name):
        assert make(p, m) == torch_order(name, p, m), (p, m)


def test_zb_h1_order_equals_pytorchs_zero_bubble_schedule_with_one_stage_per_rank():
    checked = 0
    for p, m in _grid("zb_h1"):
        if m >= p and m % (m // p):  # PyTorch needs m to be a multiple of m // p
            with pytest.raises(ValueError, match="multiple of the number of rounds"):
                torch_order("zb_h1", p, m)
            validate(zb_h1(p, m))  # ours runs any m
            continue
        assert zb_h1(p, m) == torch_order("zb_h1", p, m), (p, m)
        checked += 1
    assert checked >= 40


# -- the runtime ------------------------------------------------------------------------------

@pytest.mark.parametrize("name, p, m", [("zb_h1", 2, 4), ("zb_h1", 4, 8), ("zb_h1", 4, 3),
                                        ("zb_v", 2, 4), ("zb_v", 4, 8), ("zb_v", 4, 5),
                                        ("dualpipe_v", 2, 4), ("dualpipe_v", 4, 8)])
def test_split_backward_gradients_and_training_equal_one_process(name, p, m):
    for grad_diff, param_diff, run in run_ranks(_train, p, name, m, 2, 3):
        assert grad_diff <= 1e-6 and param_diff <= 1e-6


def test_w_runs_after_its_b_and_the_last_rank_of_the_v_is_rank_0():
    runs = [run for _, _, run in run_ranks(_train, 2, "zb_v", 4, 2, 1)]
    assert runs[0].loss is not None and runs[1].loss is None  # stage 2p-1 lives on rank 0
    for stage, run in enumerate(runs):
        assert [(e.args["kind"], e.args["mb"], e.args["chunk"]) for e in run.events] == \
            [tuple(a) for a in zb_v(2, 4)[stage]]
        end_of_b = {(e.args["mb"], e.args["chunk"]): e.end for e in run.events
                    if e.args["kind"] == "B"}
        assert all(e.start >= end_of_b[e.args["mb"], e.args["chunk"]] for e in run.events
                   if e.args["kind"] == "W")


def _stash_bytes_per_micro_batch(rows=4, width=16, linears=4):
    """W keeps each linear layer's input X and output gradient dY: (rows x width) fp32 each."""
    return linears * 2 * rows * width * 4


@pytest.mark.parametrize("name", ["1f1b", "zb_h1", "zb_v"])
def test_memory_held_per_stage_is_the_orders_count_times_the_measured_sizes(name):
    p, m = 2, 4
    make, placement = SCHEDULES.get(name, (one_f_one_b, "interleaved"))
    v = 2 if placement == "v" else 1
    runs = [run for _, _, run in run_ranks(_train, p, name, m, 2, 1)]
    for stage, run in enumerate(runs):
        order = make(p, m)[stage]
        split = name != "1f1b"
        stash = {c: _stash_bytes_per_micro_batch(linears=8 // (p * v)) for c in range(v)}
        assert run.weight_stash_bytes == (stash if split else {})
        held = peak = grads = peak_grads = 0  # replay the order with the measured sizes
        for a in order:
            if a.kind == "F":
                held += run.activation_bytes[a.chunk]
            elif a.kind == "B":
                held -= run.activation_bytes[a.chunk]
                if split:
                    held, grads = held + stash[a.chunk], grads + stash[a.chunk] // 2
            else:
                held, grads = held - stash[a.chunk], grads - stash[a.chunk] // 2
            peak, peak_grads = max(peak, held), max(peak_grads, grads)
        assert run.peak_activation_bytes == peak
        assert run.peak_grad_stash_bytes == peak_grads
        sim = simulate(make(p, m), placement=placement, t_w=1)
        assert run.peak_in_flight == sim.peak_in_flight[stage]
        assert run.peak_held == sim.peak_held[stage]


def test_the_gantt_chart_shows_w_and_the_explorer_runs_every_schedule():
    from engine.labs.pipeline import schedule_by_name
    from engine.viz.pipeline import SCHEDULES, formula_line, gantt_figure, pipeline_explorer

    result = simulate(zb_v(2, 4), t_w=1.0, placement="v")
    fig = gantt_figure(result.timeline)
    assert len(fig.axes[0].patches) == len(result.timeline) == 2 * 2 * 4 * 3  # F, B and W
    labels = {t.get_text() for t in fig.axes[0].get_legend().get_texts()}
    assert {"B: input gradient", "W: weight gradient"} <= labels
    for key in SCHEDULES.values():
        built = schedule_by_name(key, 4, 8)
        assert simulate(built.actions, placement=built.placement).peak_in_flight  # its placement
    expected = theory.zb_h1_bubble_fraction(4, 8, 1.0, 1.0, 0.5)
    assert f"{expected:.1%}" in formula_line("ZB-H1", 4, 8, 1, 1.0, 1.0, 0.5)
    with pytest.raises(ValueError, match="kind must be one of gpipe, 1f1b, interleaved, zb_h1"):
        schedule_by_name("zb_h3", 4, 8)  # (zb_h2 is registered since issue 32)
    assert pipeline_explorer() is not None
