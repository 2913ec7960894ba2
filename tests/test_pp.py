"""engine.pp: schedules as data (bubbles equal the formulas exactly), and a runtime whose
gradients equal one process's, checked against torch.distributed.pipelining."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import theory
from engine.pp import (Action, balanced_boundaries, gpipe, interleaved_1f1b, measured_bubble,
                       one_f_one_b, run_pipeline, simulate, split_model, uniform_boundaries,
                       validate, virtual_stages)
from engine.observe.nccl_rules import nccl_rules
from engine.labs.pipeline import schedule_by_name
from engine.pp.reference import torch_order
from tests.helpers import BEYOND_CPU, DEVICE_WORLD_SIZES, rank_device, run_ranks

# -- schedules ------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [gpipe, one_f_one_b], ids=["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_uniform_bubble_equals_p_minus_1_over_m_plus_p_minus_1(make, p, m):
    result = simulate(make(p, m), t_f=1.0, t_b=2.0)
    assert result.bubble == pytest.approx(theory.bubble_fraction(p, m), abs=1e-12)
    assert result.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert result.bubble_vs_ideal() == pytest.approx(
        theory.bubble_fraction(p, m, relative_to="ideal"), abs=1e-12)


@pytest.mark.parametrize("p, v", [(2, 2), (2, 3), (4, 2), (4, 3)])
@pytest.mark.parametrize("rounds", [1, 2, 4])
def test_interleaving_divides_the_bubble_by_v(p, v, rounds):
    m = rounds * p
    result = simulate(interleaved_1f1b(p, m, v))
    assert result.bubble == pytest.approx(theory.bubble_fraction(p, m, v), abs=1e-12)
    assert result.bubble_vs_ideal() == pytest.approx((p - 1) / (v * m), abs=1e-12)


@pytest.mark.parametrize("p, m", [(4, 8), (4, 2), (3, 16), (8, 1)])
def test_one_f_one_b_holds_at_most_p_minus_s_micro_batches(p, m):
    peaks = simulate(one_f_one_b(p, m)).peak_in_flight
    assert peaks == {s: min(p - s, m) for s in range(p)}
    assert simulate(gpipe(p, m)).peak_in_flight == {s: m for s in range(p)}  # GPipe: all m


def test_one_f_one_b_warm_up_is_p_minus_s_minus_1_forwards():
    schedule = one_f_one_b(4, 8)
    for s, actions in schedule.items():
        warmup = next(i for i, a in enumerate(actions) if a[0] == "B") - 1
        assert warmup == 4 - s - 1


def _torch_interleaved_order(p, m, v):
    return torch_order("interleaved_1f1b", p, m, v)  # built from PyTorch's schedule itself


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (4, 12, 3), (2, 8, 3)])
def test_interleaved_order_equals_pytorchs_when_m_exceeds_p(p, m, v):
    assert interleaved_1f1b(p, m, v) == _torch_interleaved_order(p, m, v)


def test_with_m_equal_to_p_megatron_and_pytorch_differ_and_both_are_valid():
    # Megatron-LM runs every forward first when m == p; PyTorch keeps its usual warm-up.
    # Neither is wrong: both validate, with the same simulated bubble.
    ours, theirs = interleaved_1f1b(4, 4, 2), _torch_interleaved_order(4, 4, 2)
    assert ours != theirs
    validate(theirs)
    assert simulate(ours).bubble == pytest.approx(simulate(theirs).bubble)


def test_validate_names_what_is_wrong():
    with pytest.raises(ValueError, match="stage 1 must run F and B of every micro-batch once"):
        validate({0: [("F", 0), ("B", 0)], 1: [("F", 0)]})
    with pytest.raises(ValueError, match=r"stage 0 runs \('B', 0\) before its forward"):
        validate({0: [("B", 0), ("F", 0)], 1: [("F", 0), ("B", 0)]})
    with pytest.raises(ValueError, match="deadlock"):  # stage 1 waits for F1 first
        validate({0: [("F", 0), ("B", 0), ("F", 1), ("B", 1)],
                  1: [("F", 1), ("B", 1), ("F", 0), ("B", 0)]})


def test_actions_are_typed_and_schedules_stay_plain_data():
    schedule = interleaved_1f1b(2, 4, 2)
    assert type(schedule) is dict and all(type(a) is Action for a in schedule[0])
    first = schedule[0][0]
    assert (first.kind, first.mb, first.chunk) == ("F", 0, 0) and first == ("F", 0, 0)
    assert Action("B", 3) == Action("B", 3, 0) and repr(Action("F", 2, 1)) == "F2c1"
    # plain tuples, with or without the chunk, are read as the same schedule
    as_tuples = {s: [tuple(a) if a.chunk else (a.kind, a.mb) for a in acts]
                 for s, acts in schedule.items()}
    assert simulate(as_tuples).bubble == simulate(schedule).bubble


@pytest.mark.parametrize("bad, error, message", [
    ({0: [("F", 0), ("X", 0)]}, ValueError, "action kind must be one of 'F', 'B', 'W'; got 'X'"),
    ({0: [("F", -1), ("B", -1)]}, ValueError, "micro-batch of \\('F', -1\\) must be an int >= 0"),
    ({0: [("F", 0, 1.5), ("B", 0)]}, ValueError, "chunk of \\('F', 0, 1.5\\) must be an int"),
    ({0: ["F0", "B0"]}, TypeError, "a pipeline action is \\(kind, micro-batch\\[, chunk\\]\\)"),
    ([("F", 0)], TypeError, "a schedule is a non-empty dict"),
])
def test_a_malformed_action_is_named(bad, error, message):
    with pytest.raises(error, match=message):
        validate(bad)


def test_one_f_one_b_needs_asynchronous_sends():
    validate(one_f_one_b(4, 8))
    validate(gpipe(4, 8), blocking_sends=True)
    with pytest.raises(ValueError, match="deadlock"):  # two neighbours both sending
        validate(one_f_one_b(4, 8), blocking_sends=True)


@pytest.mark.parametrize("call, message", [
    (lambda: gpipe(2, 0), "m \\(micro-batches\\) must be a positive int, got 0"),
    (lambda: one_f_one_b(0, 4), "p \\(stages\\) must be a positive int, got 0"),
    (lambda: interleaved_1f1b(4, 6, 2), "m \\(micro-batches\\) to be a multiple of p "
                                        "\\(stages\\): got m=6, p=4"),
    (lambda: uniform_boundaries(3, 4), "cannot cut 3 layers into 4 pipeline stages"),
    (lambda: split_model(nn.Sequential(nn.Linear(2, 2), nn.Tanh()), [0, 0]),
     "boundaries must start at 0, increase strictly"),
    (lambda: theory.bubble_fraction(4, 8, relative_to="busy"), "'total' or 'ideal'"),
])
def test_bad_input_is_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def _slowest(times, starts):
    ends = starts[1:] + [len(times)]
    return max(sum(times[a:b]) for a, b in zip(starts, ends))


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_balanced_partition_minimises_the_slowest_stage(parts):
    import itertools

    times = [1, 1, 1, 1, 4, 4, 1, 1, 2, 3]
    best = min(_slowest(times, [0, *cuts])
               for cuts in itertools.combinations(range(1, len(times)), parts - 1))
    assert _slowest(times, balanced_boundaries(times, parts)) == best  # brute force agrees
    assert _slowest(times, uniform_boundaries(len(times), parts)) >= best


# -- the runtime ----------------------------------------------------------------------------

def _model(layers=8, width=16):
    torch.manual_seed(0)
    modules = []
    for _ in range(layers):
        modules += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*modules)


def _data(m, rows=4):
    x = torch.randn(rows * m, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randn(rows * m, 16, generator=torch.Generator().manual_seed(2))
    return list(x.chunk(m)), list(y.chunk(m))


def _train(rank, p, kind, m, v, steps, device="cpu"):
    """``steps`` training steps of schedule ``kind`` (``schedule_by_name``: ``v`` counts for
    the interleaved one) against one process, under NCCL's rules (``nccl_rules``: what would
    fail or hang on NCCL is refused); (first gradients' and last parameters' largest
    difference, the last run)."""
    with nccl_rules(rank_device(device)):
        return _train_under_rules(rank, p, kind, m, v, steps, device)


def _train_under_rules(rank, p, kind, m, v, steps, device):
    schedule = schedule_by_name(kind, p, m, v)  # built and checked once, run at every step
    placement, v = schedule.placement, schedule.v
    on = rank_device(device)
    xs, ys = ([t.to(on) for t in ts] for ts in _data(m))
    ref = _model().to(on)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    pieces = split_model(_model().to(on), uniform_boundaries(16, p * v))
    ref_pieces = split_model(ref, uniform_boundaries(16, p * v))
    held = virtual_stages(rank, p, v, placement)
    mine, theirs = [pieces[i] for i in held], [ref_pieces[i] for i in held]
    opt = torch.optim.SGD([q for c in mine for q in c.parameters()], lr=0.1)
    grad_diff, runs = None, []
    for _ in range(steps):
        ref_opt.zero_grad()
        (sum(nn.functional.mse_loss(ref(a), b) for a, b in zip(xs, ys)) / m).backward()
        opt.zero_grad()
        runs.append(run_pipeline(mine, schedule, xs, ys, stage=rank))
        if grad_diff is None:
            grad_diff = max((a.grad - b.grad).abs().max().item() for c in range(v)
                            for a, b in zip(mine[c].parameters(), theirs[c].parameters()))
        ref_opt.step()
        opt.step()
    param_diff = max((a - b).abs().max().item() for c in range(v)
                     for a, b in zip(mine[c].parameters(), theirs[c].parameters()))
    return grad_diff, param_diff, runs[-1]


CASES = [(p, kind, m) for p in (2, 4) for kind in ("gpipe", "1f1b") for m in (1, 2, 4, 8)] + \
    [(p, "interleaved", m) for p in (2, 4) for m in (p, 2 * p)]


@pytest.mark.parametrize("p, kind, m", CASES)
def test_pipeline_gradients_and_training_equal_one_process(p, kind, m):
    v = 2 if kind == "interleaved" else 1
    for grad_diff, param_diff, run in run_ranks(_train, p, kind, m, v, 3):
        assert grad_diff <= 1e-6 and param_diff <= 1e-6


@pytest.mark.parametrize("device", BEYOND_CPU)
@pytest.mark.parametrize("p", DEVICE_WORLD_SIZES)
@pytest.mark.parametrize("kind", ["1f1b", "interleaved"])
def test_pipeline_equals_one_process_on_each_device(device, p, kind):
    v = 2 if kind == "interleaved" else 1
    for grad_diff, param_diff, _ in run_ranks(_train, p, kind, 2 * p, v, 2, device,
                                              device=device):
        assert grad_diff <= 1e-6 and param_diff <= 1e-6


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_gpipe_holds_m_micro_batches_of_activations_1f1b_at_most_p_minus_s(kind):
    p, m = 4, 8
    for stage, (_, _, run) in enumerate(run_ranks(_train, p, kind, m, 1, 1)):
        per_micro_batch = run.activation_bytes[0]
        held = m if kind == "gpipe" else min(p - stage, m)
        assert run.peak_in_flight == held
        assert run.peak_activation_bytes == held * per_micro_batch


def test_the_last_stage_reports_the_loss_and_the_timeline_has_every_action():
    runs = [run for _, _, run in run_ranks(_train, 2, "1f1b", 4, 1, 1)]
    assert runs[0].loss is None and runs[1].loss > 0
    for run in runs:
        assert sorted(e.name for e in run.events) == sorted(
            [f"F{i}" for i in range(4)] + [f"B{i}" for i in range(4)])
    bubble = measured_bubble([e for run in runs for e in run.events], 2)
    assert 0 < bubble < 1


def _against_torch(rank, p, m, which):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    xs, ys = _data(m)
    piece = split_model(_model(), uniform_boundaries(16, p))[rank]
    ours = split_model(_model(), uniform_boundaries(16, p))[rank]
    stage = PipelineStage(piece, rank, p, torch.device("cpu"))
    order = []
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def logged_forward(i, *args, **kwargs):
        order.append(Action("F", i))
        return forward(i, *args, **kwargs)

    def logged_backward(i, *args, **kwargs):
        order.append(Action("B", i))
        return backward(i, *args, **kwargs)

    stage.forward_one_chunk, stage.backward_one_chunk = logged_forward, logged_backward
    schedule = (ScheduleGPipe if which == "gpipe" else Schedule1F1B)(
        stage, m, loss_fn=nn.functional.mse_loss)
    if rank == 0:
        schedule.step(torch.cat(xs))
    elif rank == p - 1:
        schedule.step(target=torch.cat(ys))
    else:
        schedule.step()
    ours_schedule = gpipe(p, m) if which == "gpipe" else one_f_one_b(p, m)
    with nccl_rules("cpu"):
        run_pipeline([ours], ours_schedule, xs, ys, stage=rank)
    grad_diff = max((a.grad - b.grad).abs().max().item()
                    for a, b in zip(piece.parameters(), ours.parameters()))
    return order == ours_schedule[rank], grad_diff


@pytest.mark.parametrize("which", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8)])
def test_same_order_and_gradients_as_torch_distributed_pipelining(which, p, m):
    for same_order, grad_diff in run_ranks(_against_torch, p, m, which):
        assert same_order
        assert grad_diff <= 1e-6


def _run_with_stage(rank, world_size, stage, positional):
    schedule, chunk = one_f_one_b(2, 2), nn.Linear(4, 4)
    data = [torch.ones(1, 4)] * 2
    if positional:  # the old call, with the rank first
        return run_pipeline(rank, [chunk], schedule, data, data)
    return run_pipeline([chunk], schedule, data, data, stage=stage(rank))


@pytest.mark.parametrize("stage, positional, error, message", [
    (lambda rank: rank + 2, False, ValueError,
     "stage=[23] is not a stage of this 2-stage schedule \\(expected 0..1\\): pass this rank's "
     "position in the pipeline group"),
    (lambda rank: 1 - rank, False, ValueError,
     "stage=([01]), but this process \\(global rank ([01])\\) is stage \\2 of the pipeline "
     "group \\[0, 1\\]"),
    (lambda rank: True, False, ValueError, "stage=True is not a stage"),
    (None, True, TypeError, "run_pipeline needs stage=, this rank's position in the pipeline"),
])
def test_a_wrong_stage_is_a_clear_error(stage, positional, error, message):
    with pytest.raises(Exception, match=message) as caught:
        run_ranks(_run_with_stage, 2, stage, positional)
    assert error.__name__ in str(caught.value)


def test_a_schedule_for_another_pipeline_size_is_refused():
    def run(rank, world_size):
        data = [torch.ones(1, 4)] * 2
        run_pipeline([nn.Linear(4, 4)], one_f_one_b(4, 2), data, data, stage=rank)

    with pytest.raises(Exception, match="the schedule has p=4 stages but the pipeline group "
                                        "has 2 ranks"):
        run_ranks(run, 2)


def test_a_deadlocking_schedule_is_refused_before_any_message():
    def run(rank, world_size):
        bad = {0: [("F", 0), ("B", 0), ("F", 1), ("B", 1)],
               1: [("F", 1), ("B", 1), ("F", 0), ("B", 0)]}
        chunk = nn.Linear(4, 4)
        run_pipeline([chunk], bad, [torch.ones(1, 4)] * 2, [torch.ones(1, 4)] * 2, stage=rank)

    with pytest.raises(Exception, match="deadlock"):
        run_ranks(run, 2)
