"""ZB-H2 (Qi et al. 2024, "Zero bubble schedule"): the order as data, its bubble against the
formula (p-1)(F+B-2W) on a grid of times, the micro-batches it holds, its gradients and
training on real ranks equal to one process, and post-validation (the optimizer step checked
after it runs) equal to clipping before it."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch

from engine import theory
from engine.pp import Action, one_f_one_b, simulate, validate
from engine.pp.post_validation import back_to_back, own_span_idle, step_then_validate, step_times
from engine.pp.registry import build_schedule
from engine.pp.zero_bubble import dualpipe_v, zb_h1, zb_h2, zb_v
from tests.helpers import run_ranks
from tests.test_pp import _train

TIMES = (0.25, 0.5, 1.0, 1.5, 2.0)


def test_every_micro_batch_gets_f_b_and_w_once_w_after_b_and_it_is_registered():
    for p, m in itertools.product((1, 2, 3, 4, 6), range(1, 16)):
        schedule = zb_h2(p, m)
        validate(schedule)
        for actions in schedule.values():
            assert Counter(actions) == Counter(Action(k, mb) for k in "FBW" for mb in range(m))
            assert all(actions.index(Action("B", a.mb)) < actions.index(a)
                       for a in actions if a.kind == "W")
    built = build_schedule("zb_h2", 4, 8)
    assert (built.actions, built.placement, built.v, built.split) == \
        (zb_h2(4, 8), "interleaved", 1, True)
    with pytest.raises(ValueError, match="m \\(micro-batches\\)"):
        zb_h2(4, 0)


@pytest.mark.parametrize("p", [2, 4])
def test_zb_h2_idles_the_papers_formula_inside_each_step_and_between_steps(p):
    """Exact (to float rounding) on the grid when m >= 2p-1 and W <= F, B: stage 0's idle time
    inside its own span, and the time one more step adds with steps back to back."""
    checked = 0
    for t_f, t_b, t_w in itertools.product(TIMES, TIMES, TIMES):
        if t_w > min(t_f, t_b):
            with pytest.raises(ValueError, match="T_W <= T_F"):
                theory.zb_h2_bubble_time(p, t_f, t_b, t_w)
            continue
        formula = theory.zb_h2_bubble_time(p, t_f, t_b, t_w)
        for m in (2 * p - 1, 3 * p):
            times = dict(t_f=t_f, t_b=t_b, t_w=t_w)
            assert own_span_idle(simulate(zb_h2(p, m), **times))[0] == pytest.approx(
                formula, abs=1e-9)
            steady = step_times(zb_h2(p, m), steps=3, **times)["post_validated"]
            assert steady - m * (t_f + t_b + t_w) == pytest.approx(formula, abs=1e-9)
            checked += 1
    assert checked >= 100


def test_zero_bubble_when_f_b_and_w_take_the_same_time():
    for p, m in ((2, 4), (4, 8), (4, 12), (8, 16)):
        result = simulate(zb_h2(p, m), t_f=1, t_b=1, t_w=1)
        assert own_span_idle(result) == {s: 0 for s in range(p)}  # a parallelogram
        assert theory.zb_h2_bubble_time(p, 1, 1, 1) == 0
        times = step_times(zb_h2(p, m), t_sync=0.5, t_f=1, t_b=1, t_w=1)
        assert times["post_validated"] == times["busy"] == 3 * m  # no bubble at all
        assert times["synchronised"] == 3 * m + (p - 1) + 0.5  # the slant and the all-reduce
        assert simulate(zb_h1(p, m), t_f=1, t_b=1, t_w=1).idle()[0] == p - 1  # ZB-H1: (p-1)W


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zb_h2_holds_2p_minus_1_micro_batches_on_every_stage(p):
    result = simulate(zb_h2(p, 3 * p), t_w=1)
    assert result.peak_held == {s: 2 * p - 1 for s in range(p)}  # F to W: the paper's (2p-1)
    assert result.peak_in_flight == {s: 2 * (p - s) - 1 for s in range(p)}  # F to B
    assert theory.pipeline_peak_activations("zb_h2", p) == 2 * p - 1
    first = simulate(one_f_one_b(p, 3 * p)).peak_in_flight[0]
    assert first == theory.pipeline_peak_activations("1f1b", p) == p


def test_fewer_micro_batches_than_2p_minus_1_cannot_fill_the_warm_up():
    for p in (3, 4, 5):
        m = 2 * p - 2
        idle = own_span_idle(simulate(zb_h2(p, m), t_f=1, t_b=1, t_w=1))[0]
        assert idle > theory.zb_h2_bubble_time(p, 1, 1, 1)


def test_back_to_back_renumbers_the_steps_and_keeps_each_stages_order():
    two = back_to_back(zb_h2(2, 3), 2)
    assert two[0][:5] == [Action("F", 0), Action("F", 1), Action("F", 2), Action("B", 0),
                          Action("W", 0)]
    assert [a for a in two[1] if a.mb >= 3] == [Action(a.kind, a.mb + 3) for a in zb_h2(2, 3)[1]]
    validate(two)


def test_post_validation_saves_the_synchronising_wait_of_every_zero_bubble_schedule():
    times = dict(t_f=1, t_b=1, t_w=1)
    for plan, placement in ((zb_h1(4, 8), "interleaved"), (zb_h2(4, 8), "interleaved"),
                            (zb_v(4, 8), "v"), (dualpipe_v(4, 8), "v")):
        t = step_times(plan, t_sync=0.5, placement=placement, **times)
        assert t["busy"] <= t["post_validated"] < t["synchronised"]


@pytest.mark.parametrize("scale, outcome", [(1e-3, "kept"), (1e3, "clipped"),
                                            (float("nan"), "skipped")])
def test_step_then_validate_equals_clipping_before_the_step(scale, outcome):
    """Two stages with AdamW: step first, check after, roll back and redo when the check fails;
    the same parameters as clip_grad_norm_ before one optimizer step over both stages. Not
    bit-exact when clipped: the norm is summed in float64 here, in float32 by torch."""
    torch.manual_seed(0)
    ours, ref = ([torch.nn.Linear(4, 4) for _ in range(2)] for _ in range(2))
    for a, b in zip(ours, ref):
        b.load_state_dict(a.state_dict())
    x = torch.randn(3, 4)
    for stages in (ours, ref):
        (stages[1](stages[0](x)).sum() * scale).backward()
    opts = [torch.optim.AdamW(s.parameters(), lr=0.1) for s in ours]
    result = step_then_validate([(s.parameters(), o) for s, o in zip(ours, opts)], 1.0)
    ref_params = [q for s in ref for q in s.parameters()]
    norm = torch.nn.utils.clip_grad_norm_(ref_params, 1.0)
    if torch.isfinite(norm):
        torch.optim.AdamW(ref_params, lr=0.1).step()
    assert result["outcome"] == outcome
    assert math.isnan(result["norm"]) if outcome == "skipped" else \
        result["norm"] == pytest.approx(float(norm), rel=1e-6)
    diff = max((a - b).abs().max().item() for s, r in zip(ours, ref)
               for a, b in zip(s.parameters(), r.parameters()))
    assert diff <= (1e-6 if outcome == "clipped" else 0.0)
    if outcome == "skipped":
        assert all(not o.state for o in opts)  # the rolled-back step left no Adam moments


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8)])
def test_zb_h2_gradients_and_training_equal_one_process(p, m):
    for grad_diff, param_diff, run in run_ranks(_train, p, "zb_h2", m, 1, 3):
        assert grad_diff <= 1e-6 and param_diff <= 1e-6
        assert run.peak_held == 2 * p - 1  # every rank, as simulated


@pytest.mark.parametrize("p", [2, 4])
def test_zb_h2_sends_in_batches_that_cannot_deadlock_on_nccl(p):
    from tests import test_pp_p2p  # the module, so that its tests are not collected twice

    test_pp_p2p.test_every_pipeline_send_is_posted_in_a_batch_and_the_batches_cannot_deadlock(
        "zb_h2", p)


def test_the_explorer_offers_zb_h2_with_its_formula():
    from engine.viz.pipeline import SCHEDULES, formula_line

    assert SCHEDULES["ZB-H2"] == "zb_h2"
    line = formula_line("ZB-H2", 4, 8, 1, 1.0, 1.5, 0.5)
    assert f"= {theory.zb_h2_bubble_time(4, 1.0, 1.5, 0.5):g} idle per stage" in line
    assert "needs m >= 2p-1" in formula_line("ZB-H2", 4, 6, 1, 1.0, 1.0, 1.0)
