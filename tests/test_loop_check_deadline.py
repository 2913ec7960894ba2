"""The notebook's ``check()`` has a time limit: a learner's function that never returns, called
by a check in the grading process itself (not on ranks, whose launch has its own timeout),
fails the exercise with "took longer than N s" and the line it loops on, instead of hanging
the notebook. It is the grader's command-line mechanism (engine.grading.isolated.run_isolated),
with the same default limit."""

from __future__ import annotations

import time

import pytest

from engine.grading import check, load_impl, registry, run_checks
from engine.grading import isolated
from tests.helpers import descendants

LIMIT_S = 2
MARGIN_S = 10  # forking the child, reading where it loops and killing it, on a busy machine


@pytest.fixture(autouse=True)
def _learner_state_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("DRILL_SCORES", str(tmp_path / "learner" / "drill.json"))


def _loops_forever(p, m):
    spins = 0
    while True:  # the learner's endless loop
        spins += 1


def test_a_check_that_loops_forever_fails_within_its_deadline(monkeypatch, capsys):
    monkeypatch.setattr(isolated, "DEFAULT_TIMEOUT_S", LIMIT_S)
    start = time.monotonic()
    check("ch06.one_f_one_b", impl=_loops_forever)
    elapsed = time.monotonic() - start
    out = capsys.readouterr().out
    assert LIMIT_S <= elapsed < LIMIT_S + MARGIN_S, elapsed
    assert "FAIL" in out and "0/3 checks passed" in out, out
    assert f"took longer than {LIMIT_S} s, the time limit of one exercise" in out, out
    assert "spins += 1" in out or "while True" in out, out  # where it loops
    assert f"not run: valid_and_deadlock_free took longer than {LIMIT_S} s" in out, out
    assert descendants() == []


def test_the_time_limit_can_be_given_and_is_checked(capsys):
    start = time.monotonic()
    check("ch06.one_f_one_b", impl=_loops_forever, timeout=1.5)
    assert time.monotonic() - start < 1.5 + MARGIN_S
    assert "took longer than 1.5 s" in capsys.readouterr().out
    for bad in (0, -1, True, "5"):
        with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
            check("ch06.one_f_one_b", impl=_loops_forever, timeout=bad)


def test_a_check_grades_as_before_and_shows_what_the_learner_printed(capfd):
    """The same verdicts as grading in this process; a print in the learner's function reaches
    the output once (the child flushes it, the grader flushed its own before the fork)."""
    one_f_one_b = load_impl(registry()["ch06.one_f_one_b"], "solutions")

    def talkative(p, m):
        print(f"my schedule for p={p}, m={m}")
        return one_f_one_b(p, m)

    print("before the check")
    check("ch06.one_f_one_b", impl=talkative)
    out = capfd.readouterr().out
    assert out.count("before the check") == 1 and "my schedule for p=" in out, out
    assert "PASS" in out and "3/3 checks passed" in out, out
    in_process = run_checks("ch06.one_f_one_b", impl=talkative)
    assert in_process.passed
