"""Passes that teach: a passing check prints what it measured beside its formula, in one line,
after its ✓ (``engine.grading.passed``)."""

from __future__ import annotations

from engine import theory
from engine.grading import format_report, passed, run_checks


def test_passed_puts_the_measurement_beside_the_formula():
    assert passed("sent 1.50 x S", "2(N-1)/N", N=4) == "sent 1.50 x S = 2(N-1)/N at N = 4"
    assert passed("bubble 0.2", "(p-1)/(m+p-1)", p=2, m=4) == \
        "bubble 0.2 = (p-1)/(m+p-1) at p = 2, m = 4"
    assert passed("6 rounds", "2(N-1)") == "6 rounds = 2(N-1)"


def _lines(name: str) -> dict[str, str]:
    report = run_checks(name, source="solutions")
    assert report.passed
    text = format_report(report, color=False)
    return {line.split("✓ ")[1].split(":")[0]: line for line in text.splitlines() if "✓" in line}


def test_the_ring_check_prints_what_each_rank_sent_beside_2_n_minus_1_over_n():
    lines = _lines("ch01.ring_all_reduce")
    ratios = ", ".join(f"{theory.ring_all_reduce_bytes(1.0, n):.2f}" for n in (2, 3, 4))
    assert lines["sends_2_n_minus_1_over_n"] == (
        f"  ✓ sends_2_n_minus_1_over_n: sent {ratios} x S = 2(N-1)/N at N = 2, 3, 4")
    assert lines["sums_exactly"] == "  ✓ sums_exactly"  # nothing measured, nothing added


def test_the_broadcast_check_prints_its_copies_beside_n_minus_1():
    lines = _lines("ch00.p2p_broadcast")
    assert lines["traffic_is_n_minus_1_copies"].endswith(
        "traffic_is_n_minus_1_copies: sent 1, 2, 3 x S in all = N-1 at N = 2, 3, 4")


def test_the_1f1b_check_prints_the_simulated_bubble_beside_its_formula():
    lines = _lines("ch06.one_f_one_b")
    assert lines["bubble_is_the_formula"].endswith(
        f"simulated bubble {theory.bubble_fraction(8, 16):.3f} = (p-1)/(m+p-1) at p = 8, m = 16")


def test_a_failing_check_has_no_note():
    report = run_checks("ch06.one_f_one_b", impl=lambda p, m: {s: [] for s in range(p)})
    assert not any(r.passed for r in report.results[:2]) and all(
        r.note == "" for r in report.results if not r.passed)
