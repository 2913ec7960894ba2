"""The grader grades: every check passes on the reference and fails on the untouched stub.

This runs for every registered exercise automatically. A learner who has filled in
``exercises/`` sees the stub half skipped with the reason; in CI (``CI`` set) it always runs.
"""

from __future__ import annotations

import inspect
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine.comm import ops
from engine.grading import (CheckResult, Frame, Report, check, format_report, load_impl,
                            registry, run_checks)
from engine.grading.__main__ import main as grade_main
from engine.grading.progress import Attempts

EXERCISES = sorted(registry())
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _learner_state_in_tmp(tmp_path, monkeypatch):
    """check() and the grade command save attempts beside the drill's scores: not in ~."""
    monkeypatch.setenv("DRILL_SCORES", str(tmp_path / "learner" / "drill.json"))


def test_there_are_exercises():
    assert "ch00.p2p_broadcast" in EXERCISES


@pytest.mark.parametrize("name", EXERCISES)
def test_every_check_passes_on_the_solution(name):
    report = run_checks(name, source="solutions")
    assert [(r.name, r.passed, r.message) for r in report.results] == [
        (r.name, True, "") for r in report.results]


@pytest.mark.parametrize("name", EXERCISES)
def test_every_check_fails_on_the_stub(name):
    exercise = registry()[name]
    stub_source = inspect.getsource(load_impl(exercise, "exercises"))
    if "raise NotImplementedError" not in stub_source and not os.environ.get("CI"):
        pytest.skip(f"exercises/{exercise.module}.py has been filled in; run in CI to prove "
                    "the checks against the pristine stub")
    report = run_checks(name, source="exercises")
    assert report.results and not any(r.passed for r in report.results)
    assert all(r.not_implemented for r in report.results)


# Wrong answers a learner might write: each must fail the check aimed at its mistake.

def _uses_builtin_broadcast(tensor, src):
    dist.broadcast(tensor, src)  # correct values, but hidden from the meter
    return tensor


def _returns_a_copy(tensor, src):
    out = tensor.clone()
    dist.broadcast(out, src)
    tensor.copy_(out)
    return out


def _always_from_rank_0(tensor, src):
    if dist.get_rank() == 0:
        for peer in range(1, dist.get_world_size()):
            ops.send(tensor, peer)
    else:
        ops.recv(tensor, 0)
    return tensor


def _sends_twice(tensor, src):
    if dist.get_rank() == src:
        for peer in range(dist.get_world_size()):
            if peer != src:
                ops.send(tensor, peer)
                ops.send(torch.zeros(1), peer)
    else:
        ops.recv(tensor, src)
        ops.recv(torch.zeros(1), src)
    return tensor


@pytest.mark.parametrize("impl, failing", [
    (_uses_builtin_broadcast, {"traffic_is_n_minus_1_copies"}),
    (_returns_a_copy, {"in_place_and_returned", "traffic_is_n_minus_1_copies"}),
    (_always_from_rank_0, {"every_rank_gets_the_source_tensor", "traffic_is_n_minus_1_copies"}),
    (_sends_twice, {"traffic_is_n_minus_1_copies"}),
])
def test_p2p_broadcast_checks_catch_wrong_answers(impl, failing):
    report = run_checks("ch00.p2p_broadcast", impl=impl)
    assert {r.name for r in report.results if not r.passed} == failing


def test_check_prints_pass_or_fail_with_a_hint_and_the_inputs(capsys):
    check("ch00.p2p_broadcast", impl=load_impl(registry()["ch00.p2p_broadcast"], "solutions"))
    out = capsys.readouterr().out
    assert "PASS" in out and "3/3 checks passed" in out and "hint" not in out

    check("ch00.p2p_broadcast", impl=_always_from_rank_0)
    out = capsys.readouterr().out
    assert "FAIL" in out and "1/3 checks passed" in out and "hint 1 (the idea):" in out
    assert "world_size = 3" in out and "src = 2" in out  # the failing inputs


def test_unknown_exercise_and_bad_impl_are_clear_errors():
    with pytest.raises(ValueError, match="no exercise named 'ch99.nope'; known exercises: ch00"):
        check("ch99.nope")
    with pytest.raises(ValueError, match="impl must be a function, got 3"):
        run_checks("ch00.p2p_broadcast", impl=3)


def test_grade_command_prints_a_table_and_writes_junit(tmp_path, capsys):
    xml = tmp_path / "grade.xml"
    assert grade_main(["--source", "solutions", "--junit", str(xml)]) == 0
    out = capsys.readouterr().out
    assert "chapter total" in out and "ch00.p2p_broadcast" in out
    suites = ET.parse(xml).getroot()
    cases = suites.findall("./testsuite/testcase")
    assert len(cases) == sum(len(e.checks) for e in registry().values())
    assert not suites.findall(".//failure")

    assert grade_main(["--only", "ch00", "--junit", str(xml)]) in (0, 1)
    with pytest.raises(SystemExit):
        grade_main(["--only", "ch42"])


def test_drills_give_instant_feedback(capsys):
    from engine import theory
    from engine.grading.drill import drill, drills, grade_drill

    question = drills()["ch00.ring_bytes"].question()  # the bank's ring item, drawn once
    size, n = (int(w) for w in question.text.split() if w.isdigit())
    assert question.answer == theory.ring_all_reduce_bytes(size, n)
    assert grade_drill("ch00.ring_bytes", question.answer) is True
    assert grade_drill("ch00.ring_bytes", 2 * size) is False  # 2·S: the N→∞ limit, not N
    assert grade_drill("ch00.ring_bytes", None) is None
    drill("ch00.ring_bytes", question.answer)
    assert "✓" in capsys.readouterr().out
    root = drills()["ch00.flat_broadcast_root"].question()
    drill("ch00.flat_broadcast_root", root.answer / 3)
    assert "✗" in capsys.readouterr().out
    with pytest.raises(ValueError, match="answer drill 'ch00.flat_broadcast_root' with a "
                                         "number"):
        grade_drill("ch00.flat_broadcast_root", "four")
    with pytest.raises(ValueError, match="no drill named 'x'"):
        grade_drill("x", 1)
    assert all(d.name.startswith("ch") and d.question().explanation
               for d in drills().values())


def _all_to_all(t, group=None):
    """Correct sums, but every rank ships its whole tensor to every other: (N-1)·S each."""
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    me = dist.get_rank()
    total = t.clone()
    incoming = torch.empty_like(t)
    for peer in ranks:
        if peer == me:
            continue
        if me < peer:
            ops.send(t, peer)
            ops.recv(incoming, peer)
        else:
            ops.recv(incoming, peer)
            ops.send(t, peer)
        total += incoming
    return t.copy_(total)


def _built_in_behind_a_decoy(t, group=None):
    """Passes a byte count by sending dummies, but sums with dist.all_reduce."""
    from engine.comm.ring import exchange

    n, r = dist.get_world_size(group), dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    decoy = torch.empty(t.numel() // n)
    for _ in range(2 * (n - 1)):
        exchange(decoy, ranks[(r + 1) % n], torch.empty_like(decoy), ranks[(r - 1) % n], group)
    dist.all_reduce(t, group=group)
    return t


def _reduce_scatter_only(t, group=None):
    from engine.comm import ring_reduce_scatter

    ring_reduce_scatter(t, check=False)
    return t


@pytest.mark.parametrize("impl, failing", [
    (_all_to_all, {"sends_2_n_minus_1_over_n"}),
    (_reduce_scatter_only, {"sums_exactly", "sends_2_n_minus_1_over_n"}),
    (_built_in_behind_a_decoy, {"sums_exactly", "sends_2_n_minus_1_over_n"}),
])
def test_ring_all_reduce_checks_catch_wrong_answers(impl, failing):
    report = run_checks("ch01.ring_all_reduce", impl=impl)
    assert {r.name for r in report.results if not r.passed} == failing


def test_volume_formula_checks_catch_the_seed_documents_claims():
    import types

    from solutions import ch01_volume_formulas as good

    wrong_ring = types.SimpleNamespace(  # "2(N-1)M" per rank: a common wrong answer
        ring_bytes_per_rank=lambda s, n: 2 * (n - 1) * s, ps_worker_bytes=good.ps_worker_bytes,
        ps_server_bytes=good.ps_server_bytes)
    report = run_checks("ch01.volume_formulas", impl=wrong_ring)
    assert {r.name for r in report.results if not r.passed} == {"ring_bytes_per_rank"}
    wrong_server = types.SimpleNamespace(
        ring_bytes_per_rank=good.ring_bytes_per_rank, ps_worker_bytes=good.ps_worker_bytes,
        ps_server_bytes=lambda s, n: s)  # forgets the server answers every worker
    report = run_checks("ch01.volume_formulas", impl=wrong_server)
    assert {r.name for r in report.results if not r.passed} == {"ps_server_bytes"}


def _accumulate_without_no_sync(model, optimizer, micro_batches, loss_fn=None):
    from torch import nn

    optimizer.zero_grad()
    for x, y in micro_batches:
        (nn.functional.mse_loss(model(x), y) / len(micro_batches)).backward()  # syncs k times
    optimizer.step()
    return 0.0


def _accumulate_the_sum(model, optimizer, micro_batches, loss_fn=None):
    from torch import nn

    optimizer.zero_grad()
    for i, (x, y) in enumerate(micro_batches):
        loss = nn.functional.mse_loss(model(x), y)  # forgot / k
        if i < len(micro_batches) - 1:
            with model.no_sync():
                loss.backward()
        else:
            loss.backward()
    optimizer.step()
    return 0.0


@pytest.mark.parametrize("impl, failing", [
    (_accumulate_without_no_sync, {"one_all_reduce_per_step"}),
    (_accumulate_the_sum, {"equals_one_big_batch"}),
])
def test_accumulation_checks_catch_wrong_answers(impl, failing):
    report = run_checks("ch02.accumulate", impl=impl)
    assert {r.name for r in report.results if not r.passed} == failing


def _sums_without_dividing(model, group=None):
    for p in model.parameters():
        ops.all_reduce(p.grad, group=group)


def _averages_parameters_instead(model, group=None):
    n = dist.get_world_size(group)
    with torch.no_grad():
        for p in model.parameters():
            ops.all_reduce(p.data, group=group)
            p.data.div_(n)


@pytest.mark.parametrize("impl, failing", [
    (_sums_without_dividing, {"matches_full_batch_training"}),
    (_averages_parameters_instead, {"matches_full_batch_training",
                                    "adam_moments_equal_on_every_rank"}),
])
def test_averaging_checks_catch_wrong_answers(impl, failing):
    report = run_checks("ch02.average_gradients", impl=impl)
    assert {r.name for r in report.results if not r.passed} == failing


def _bucketed_variant(launch_in_finish=False, divide=True, per_parameter=False):
    """The reference, with one of the mistakes a learner might make."""
    from solutions.ch02_bucketed_ddp import BucketedDataParallel

    class Variant(BucketedDataParallel):
        def _on_grad_ready(self, p):
            if per_parameter:  # no buckets: one all-reduce per gradient, at once
                self.queue_finish()
                ops.all_reduce(p.grad, group=self.group)
                if divide:
                    p.grad.div_(dist.get_world_size(self.group))
                return
            if launch_in_finish:
                self.queue_finish()
                self.views[p].copy_(p.grad)
                return
            super()._on_grad_ready(p)

        def _finish(self):
            if per_parameter:
                return
            if launch_in_finish:  # correct sums, but no overlap with backward
                for i, buffer in enumerate(self.buffers):
                    self.works[i] = ops.all_reduce(buffer, group=self.group, async_op=True)
            if not divide:  # undo the reference's division: sums reach p.grad, not averages
                for work, buffer in zip(self.works, self.buffers, strict=True):
                    work.wait()  # the reference's own wait then returns at once
                    buffer.mul_(dist.get_world_size(self.group))
            super()._finish()

    return Variant


@pytest.mark.parametrize("variant, failing", [
    (dict(launch_in_finish=True), {"first_bucket_overlaps_backward"}),
    (dict(divide=False), {"matches_full_batch_training_bucketed"}),
    (dict(per_parameter=True), {"one_all_reduce_per_bucket"}),
])
def test_bucketed_ddp_checks_catch_wrong_answers(variant, failing):
    report = run_checks("ch02.bucketed_ddp", impl=_bucketed_variant(**variant))
    assert {r.name for r in report.results if not r.passed} == failing


def _topk_variant(forget_residual=False, floor_k=False):
    import math

    from solutions.ch03_topk_error_feedback import TopKWithErrorFeedback

    class Variant(TopKWithErrorFeedback):
        def compress(self, gradient, residual):
            corrected = gradient if (residual is None or forget_residual) else gradient + residual
            k = int(self.ratio * corrected.numel()) if floor_k else \
                max(1, math.ceil(self.ratio * corrected.numel()))
            indices = corrected.abs().topk(k, sorted=False).indices
            new_residual = corrected.clone()
            new_residual[indices] = 0
            return corrected[indices], indices, new_residual

    return Variant


@pytest.mark.parametrize("variant, failing", [
    (dict(forget_residual=True), {"error_feedback_invariant", "trains_close_to_dense"}),
    (dict(floor_k=True), {"sends_k_values_and_k_indices"}),
])
def test_topk_checks_catch_wrong_answers(variant, failing):
    report = run_checks("ch03.topk_error_feedback", impl=_topk_variant(**variant))
    assert {r.name for r in report.results if not r.passed} == failing


def _zero1_variant(full_optimizer=False, no_average=False, no_gather=False):
    from solutions.ch04_zero1_step import Zero1

    class Variant(Zero1):
        def __init__(self, params, optimizer_cls, group=None, **kwargs):
            super().__init__(params, optimizer_cls, group, **kwargs)
            if full_optimizer:  # every rank keeps the whole Adam state, like plain DP
                self.inner = optimizer_cls(self.params, **kwargs)

        @torch.no_grad()
        def step(self):
            n = dist.get_world_size(self.group)
            if full_optimizer:
                for p in self.params:
                    ops.all_reduce(p.grad, group=self.group)
                    p.grad.div_(n)
                self.inner.step()
                return
            full = self.bucket.flatten_grads()
            mine = torch.empty_like(self.bucket.shard)
            ops.reduce_scatter_tensor(mine, full, group=self.group)
            self.master.grad = mine if no_average else mine.div_(n)
            self.inner.step()
            if not no_gather:
                ops.all_gather_into_tensor(self.bucket.flat, self.bucket.shard.clone(),
                                           group=self.group)

    return Variant


@pytest.mark.parametrize("variant, failing", [
    (dict(full_optimizer=True), {"optimizer_state_is_one_nth", "sends_what_one_all_reduce_sends"}),
    (dict(no_average=True), {"equals_data_parallel_adam"}),
    (dict(no_gather=True), {"equals_data_parallel_adam", "sends_what_one_all_reduce_sends"}),
])
def test_zero1_checks_catch_wrong_answers(variant, failing):
    report = run_checks("ch04.zero1_step", impl=_zero1_variant(**variant))
    assert {r.name for r in report.results if not r.passed} == failing


def test_memory_formula_check_catches_the_four_eight_sixteen_answer():
    import types

    def seed_answer(psi, n, stage, precision="mixed"):  # "ZeRO-1 saves 4x, 2 8x, 3 16x"
        return 16 * psi / (1, 4, 8, 16)[stage]

    report = run_checks("ch04.memory_formula", impl=types.SimpleNamespace(
        bytes_per_gpu=seed_answer))
    assert not report.results[0].passed


def _parallel_linear_variant(skip_f=False, bias_before_g=False, gather_between=False):
    import types

    import torch.nn.functional as F

    import solutions.ch05_parallel_linear as good
    from engine.tp.mappings import gather_from_tp

    class Column(good.ColumnParallel):
        def forward(self, x):
            y = F.linear(x if skip_f else good.f(x, self.group), self.weight, self.bias)
            return gather_from_tp(y, self.group) if gather_between else y

    class Row(good.RowParallel):
        def forward(self, x_slice):
            if gather_between:  # got the whole output: slice it again
                x_slice = x_slice.chunk(dist.get_world_size(self.group), -1)[
                    dist.get_rank(self.group)]
            if bias_before_g:  # every rank adds the bias, then they are summed: t times
                return good.g(F.linear(x_slice, self.weight) + self.bias, self.group)
            return super().forward(x_slice)

    return types.SimpleNamespace(f=good.f, g=good.g, ColumnParallel=Column, RowParallel=Row)


@pytest.mark.parametrize("variant, failing", [
    (dict(skip_f=True), {"matches_the_dense_mlp", "one_all_reduce_each_way"}),
    (dict(bias_before_g=True), {"matches_the_dense_mlp"}),
    (dict(gather_between=True), {"one_all_reduce_each_way"}),
])
def test_parallel_linear_checks_catch_wrong_answers(variant, failing):
    report = run_checks("ch05.parallel_linear", impl=_parallel_linear_variant(**variant))
    assert {r.name for r in report.results if not r.passed} == failing


def _gpipe_instead(p, m):
    from engine.pp import gpipe

    return gpipe(p, m)


def _too_many_warmups(p, m):
    import solutions.ch06_one_f_one_b as good

    schedule = good.one_f_one_b(p + 1, m)  # warm-up of p - s forwards: one too many
    return {s: schedule[s] for s in range(p)}


def _no_warmup(p, m):
    return {s: [a for i in range(m) for a in (("F", i), ("B", i))] for s in range(p)}


@pytest.mark.parametrize("impl, failing", [
    (_gpipe_instead, {"in_flight_at_most_p_minus_s"}),
    (_too_many_warmups, {"in_flight_at_most_p_minus_s"}),
    (_no_warmup, {"bubble_is_the_formula"}),
])
def test_one_f_one_b_checks_catch_wrong_answers(impl, failing):
    report = run_checks("ch06.one_f_one_b", impl=impl)
    assert {r.name for r in report.results if not r.passed} == failing


# The learner's loop: what a failure shows (file, line, code, the ranks' output), once.

def _course(tmp_path, exercises: dict[str, str]):
    """A course folder whose exercises/ holds ``exercises`` ({module: source})."""
    for folder in ("course", "exercises", "solutions"):
        (tmp_path / folder).mkdir()
    for module, source in exercises.items():
        (tmp_path / "exercises" / f"{module}.py").write_text(source)
    return tmp_path


_BROADCAST_THAT_PRINTS_AND_RAISES = '''\
import torch.distributed as dist


def p2p_broadcast(tensor, src):
    print(f"debug: rank {dist.get_rank()} got src={src}")
    chunk = tensor[dist.get_world_size() + 3]  # line 6: past the 3 rows
    return tensor
'''


def test_a_rank_error_shows_the_learners_line_and_what_the_ranks_printed(tmp_path):
    root = _course(tmp_path, {"ch00_p2p_broadcast": _BROADCAST_THAT_PRINTS_AND_RAISES})
    report = run_checks("ch00.p2p_broadcast", root=root)
    path = str(root / "exercises" / "ch00_p2p_broadcast.py")
    for result in report.results:
        assert not result.passed and result.kind == "error"
        assert result.message.startswith("raised IndexError")
        assert [(f.file, f.line, f.function) for f in result.frames] == [
            (path, 6, "p2p_broadcast")]
        assert result.frames[0].code.startswith("chunk = tensor[dist.get_world_size() + 3]")
        assert "debug: rank" in result.output
    text = format_report(report, color=False)
    # three checks, one failure, shown once with every check it hit
    assert text.count("raised IndexError") == 1
    assert ("every_rank_gets_the_source_tensor, in_place_and_returned, "
            "traffic_is_n_minus_1_copies: rank") in text
    assert f"{path}, line 6, in p2p_broadcast" in text
    assert "chunk = tensor[dist.get_world_size() + 3]" in text
    # what the rank that raised printed before it raised is always there; a peer ended as
    # that rank failed may not have reached its print yet (under load it sometimes has not)
    shown = next(res for res in report.results if res.output)
    raised = shown.ranks[0]
    assert f"| [rank {raised}] debug: rank {raised} got src=" in text
    level = Attempts(tmp_path / "attempts.json").record(report)
    assert level == 1  # the code runs: now a hint helps
    assert "hint 1 (the idea):" in format_report(report, color=False, hint_level=level)


def test_the_same_error_on_different_ranks_is_printed_once_with_every_rank():
    """Which rank's error a launch reports first can change between checks: one line still."""
    exercise = registry()["ch00.p2p_broadcast"]
    frame = Frame("/x/exercises/ch00_p2p_broadcast.py", 7, "p2p_broadcast", "ops.send(t, 9)")
    results = [CheckResult(name, False, "raised ValueError: invalid peer 9", kind="error",
                           ranks=(rank,), frames=(frame,), output=f"[rank {rank}] hello")
               for name, rank in (("a", 0), ("b", 1), ("c", 0))]
    results.append(CheckResult("d", False, "raised ValueError: another error", kind="error",
                               ranks=(1,), frames=(frame,)))
    text = format_report(Report(exercise, "exercises", results), color=False)
    assert "✗ a, b, c: ranks 0, 1: raised ValueError: invalid peer 9" in text
    assert "✗ d: rank 1: raised ValueError: another error" in text
    assert text.count("ops.send(t, 9)") == 2 and text.count("[rank 0] hello") == 1


def test_an_error_in_a_notebook_function_points_at_that_function():
    def raises_on_the_last_rank(tensor, src):
        if dist.get_rank() == dist.get_world_size() - 1:
            raise ValueError("the last rank is not ready")
        return tensor

    report = run_checks("ch00.p2p_broadcast", impl=raises_on_the_last_rank)
    frames = {(Path(f.file).name, f.function) for r in report.results for f in r.frames}
    assert frames == {("test_grading.py", "raises_on_the_last_rank")}
    text = format_report(report, color=False)
    assert sum("raised ValueError: the last rank is not ready" in line
               for line in text.splitlines()) == 1


def test_no_hint_while_not_implemented_and_the_stub_line_is_shown(tmp_path):
    stub = "def one_f_one_b(p, m):\n    raise NotImplementedError('write me')\n"
    root = _course(tmp_path, {"ch06_one_f_one_b": stub})
    report = run_checks("ch06.one_f_one_b", root=root)
    assert all(r.not_implemented for r in report.results)
    level = Attempts(tmp_path / "attempts.json").record(report)
    text = format_report(report, color=False, hint_level=level)
    assert "not implemented yet" in text and level == 0 and "hint 1 (" not in text
    assert "line 2, in one_f_one_b" in text


def test_a_syntax_error_fails_only_its_own_exercise(tmp_path):
    good = (ROOT / "solutions" / "ch01_volume_formulas.py").read_text()
    broken = "def one_f_one_b(p, m):\n    return {s: [] for s in range(p)\n"
    root = _course(tmp_path, {"ch01_volume_formulas": good, "ch06_one_f_one_b": broken})
    xml = tmp_path / "grade.xml"
    code = grade_main(["--root", str(root), "--only", "ch01.volume_formulas,ch06.one_f_one_b",
                       "--junit", str(xml)])
    assert code == 1
    failures = ET.parse(xml).getroot().findall(".//testcase")
    failed = {c.get("classname") for c in failures if c.find("failure") is not None}
    assert failed == {"ch06.one_f_one_b"}
    report = run_checks("ch06.one_f_one_b", root=root)
    assert all(r.kind == "not loaded" for r in report.results)
    level = Attempts(tmp_path / "attempts.json").record(report)
    text = format_report(report, color=False, hint_level=level)
    assert "exercises/ch06_one_f_one_b.py does not compile" in text
    assert "line 2" in text and level == 0 and "hint 1 (" not in text


def test_an_import_error_shows_the_learners_import_line(tmp_path):
    source = "from engine.pp import no_such_schedule\n\n\ndef one_f_one_b(p, m):\n    pass\n"
    root = _course(tmp_path, {"ch06_one_f_one_b": source})
    report = run_checks("ch06.one_f_one_b", root=root)
    result = report.results[0]
    assert result.kind == "not loaded" and "raised ImportError while being imported" in \
        result.message
    assert [(f.line, f.code) for f in result.frames] == [
        (1, "from engine.pp import no_such_schedule")]


def test_a_missing_name_or_file_is_that_exercises_failure(tmp_path):
    root = _course(tmp_path, {"ch06_one_f_one_b": "def another_name(p, m):\n    pass\n"})
    assert "does not define 'one_f_one_b'" in run_checks(
        "ch06.one_f_one_b", root=root).results[0].message
    assert "ch01_volume_formulas.py does not exist" in run_checks(
        "ch01.volume_formulas", root=root).results[0].message
    with pytest.raises(ValueError, match="root must be a course folder"):
        run_checks("ch06.one_f_one_b", root=tmp_path / "exercises")


def test_checks_run_on_gloo_even_where_nccl_would_be_chosen(monkeypatch):
    """The checks' tensors are on the CPU: "auto" must not pick NCCL on a GPU machine."""
    import engine.grading.core as core

    seen = []
    monkeypatch.setattr(core, "launch", lambda fn, n, *a, **kw: seen.append(kw) or [])
    core.run_ranks(print, 2, timeout=5)
    assert seen == [{"backend": "gloo", "timeout": 5}]


# A collective from engine.comm.ops is counted on the wire too (CommMeter(count="wire") runs it
# on the engine's own point-to-point algorithms), so "every event measured" no longer tells a
# hand-written exercise from a call to the engine's collective: the checks look at the ops.

def _broadcast_through_ops(tensor, src):
    ops.broadcast(tensor, src)  # the engine's chain broadcast: N-1 copies, all counted
    return tensor


def _all_reduce_through_ops(t, group=None):
    ops.all_reduce(t, group=group)  # the engine's ring: 2(N-1)/N·S, all counted
    return t


def test_a_collective_from_ops_is_not_a_point_to_point_broadcast():
    report = run_checks("ch00.p2p_broadcast", impl=_broadcast_through_ops)
    assert {r.name for r in report.results if not r.passed} == {"traffic_is_n_minus_1_copies"}


def test_a_collective_from_ops_is_not_a_hand_written_ring():
    report = run_checks("ch01.ring_all_reduce", impl=_all_reduce_through_ops)
    assert {r.name for r in report.results if not r.passed} == {
        "sums_exactly", "sends_2_n_minus_1_over_n"}


def test_a_hanging_exercise_gets_a_verdict_within_its_deadline(monkeypatch):
    import time

    from engine.grading.chapters import ch00

    def waits_for_a_send_that_never_comes(tensor, src):
        ops.recv(tensor, (dist.get_rank() + 1) % dist.get_world_size())  # nobody sends
        return tensor

    from engine.launch import _DEADLINE_GRACE_S

    monkeypatch.setattr(ch00, "TIMEOUT_S", 3)
    start = time.monotonic()
    report = run_checks("ch00.p2p_broadcast", impl=waits_for_a_send_that_never_comes)
    # each of the three checks stops at its first case: the group's timeout, then the parent's
    # deadline; the margin is for starting and stopping ranks on a busy machine
    assert time.monotonic() - start < 3 * (3 + _DEADLINE_GRACE_S + 5)
    assert [r.kind for r in report.results] == ["stuck"] * 3
    text = format_report(report, color=False)
    assert "never finished" in text and "waits_for_a_send_that_never_comes" in text
