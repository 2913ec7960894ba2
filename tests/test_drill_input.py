"""The drill reads answers the way people type them, and never grades what it could not read.

Every input form (numbers with units, arithmetic, letters, y/n); unreadable input asked again
and not scored; the end of input stops the sitting without scoring the rest; questions printed
before their answer is read from a pipe; the original-language line labelled and optional; and
every item of the bank states a question whose answer, written as a learner would, reads back
as right.
"""

from __future__ import annotations

import json
import os
import random
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest

from engine.__main__ import main as engine_main
from engine.drill import BANK, Scores, draw
from engine.drill.answers import (UNITS, Unreadable, evaluate, example, read_letter,
                                  read_number, read_yes_no, show, unit)
from engine.drill.items import Numeric

ROOT = Path(__file__).resolve().parents[1]


# -- every input form ----------------------------------------------------------------------------

@pytest.mark.parametrize("text, asked, value", [
    ("6 rounds", "rounds", 6), ("6", "rounds", 6), ("6 steps", "rounds", 6),
    ("175 MB", "MB", 175), ("175 megabytes", "MB", 175), ("175MB", "MB", 175),
    ("0.175 GB", "MB", 175), ("175 MiB", "MB", 175 * 2**20 / 1e6),
    ("2.9%", "%", 2.9), ("2.9 %", "%", 2.9), ("2.9", "%", 2.9), ("2.9 percent", "%", 2.9),
    ("25%", "fraction", 0.25), ("0.25", "fraction", 0.25), ("1/4", "fraction", 0.25),
    ("1.5x", "x", 1.5), ("1.5", "x", 1.5), ("150%", "x", 1.5), ("1.5 psi", "x", 1.5),
    ("1.8B", "billion", 1.8), ("1.8 billion parameters", "billion", 1.8),
    ("1800 million", "billion", 1.8), ("1.8", "billion", 1.8),
    ("816 hours", "days", 34), ("34 days", "days", 34), ("0.5 s", "ms", 500),
    ("3.5e18 FLOPs", "EFLOP", 3.5), ("3.5 EFLOPs", "EFLOP", 3.5), ("10 GB/s", "GB/s", 10),
    ("4,608", "MB", 4608), ("-2.5", "x", -2.5),
])
def test_numbers_with_units(text, asked, value):
    assert read_number(text, asked) == pytest.approx(value, rel=1e-12)


@pytest.mark.parametrize("text, value", [
    ("4.5*1024", 4608), ("2*7/8*100", 175), ("(8-1)/8", 0.875), ("2^20", 2**20),
    ("2**20", 2**20), ("3 x 4", 12), ("3×4", 12), ("1e3/8", 125), (" 2 * ( 3 + 4 ) ", 14),
    ("-(1-3)", 2),
])
def test_arithmetic(text, value):
    assert read_number(text, "rounds") == value


def test_arithmetic_is_evaluated_from_the_syntax_tree_only():
    assert evaluate(" (8-1)/8 ") == 0.875 and evaluate("2**10") == 1024
    for code in ("x", "True", "'7'", "[1][0]", "(1).real", "7 if 1 else 2", "1 < 2"):
        with pytest.raises(Unreadable):
            evaluate(code)


def test_arithmetic_with_a_unit():
    assert read_number("4.5*1024 MB", "GB") == pytest.approx(4.608)
    assert read_number("2*7/8*100 %", "fraction") == pytest.approx(1.75)


@pytest.mark.parametrize("text, asked, value", [
    ("approx 1.88", "x", 1.88), ("approx. 1.88", "x", 1.88), ("approximately 1.88", "x", 1.88),
    ("~1.88x", "x", 1.88), ("~ 1.88", "x", 1.88), ("≈ 1.88", "x", 1.88), ("≈1.88x", "x", 1.88),
    ("about 175 MB", "MB", 175), ("About 0.175 GB", "MB", 175), ("around 6 rounds", "rounds", 6),
    ("roughly 2*7/8*100", "%", 175), ("about ~2.9%", "%", 2.9), ("~=1/4", "fraction", 0.25),
    ("~ -2.5", "x", -2.5),
])
def test_hedged_numbers_read_as_the_number(text, asked, value):
    """'approx', 'about', 'around', 'roughly', '~' and '≈' before a number are read as what they
    mean: the number follows (issue 31's 'approx 1.88' and '~1.88' were not read)."""
    assert read_number(text, asked) == pytest.approx(value, rel=1e-12)


def test_a_hedge_without_a_number_is_still_not_a_number():
    for text in ("approx", "about", "~", "about that"):
        with pytest.raises(Unreadable):
            read_number(text, "x")


@pytest.mark.parametrize("text, index", [
    ("a) whole heads", 0), ("A) whole heads", 0), ("b. the ring", 1), ("(c) something", 2),
    ("c: the last one", 2), ("b - the ring", 1), ("(b)the ring", 1),
    ("a) an option's text that says something else", 0),  # the letter decides
])
def test_a_letter_followed_by_its_option_text(text, index):
    assert read_letter(text, 3) == index


def test_a_letter_and_text_with_no_mark_between_is_not_read():
    for text in ("a guess", "b the ring", "d) no such option"):
        with pytest.raises(Unreadable):
            read_letter(text, 3)


@pytest.mark.parametrize("text", ["a", "A", "a)", "(a)", "A.", "a:", " ( A ) "])
def test_letters(text):
    assert read_letter(text, 3) == 0
    assert read_letter(text.replace("a", "c").replace("A", "C"), 3) == 2


@pytest.mark.parametrize("text, value", [("y", True), ("Yes", True), ("n", False),
                                         ("no", False), ("N.", False)])
def test_yes_no(text, value):
    assert read_yes_no(text) is value


@pytest.mark.parametrize("text, asked, why", [
    ("a guess", "MB", "no number"), ("", "MB", "no number"), ("A)", "MB", "'A' is not a number"),
    ("maybe 1.88", "x", "'maybe' is not a number"), ("approx", "x", "no number"),
    ("__import__('os').system('true')", "x", "only numbers"), ("len(2)", "x", "only numbers"),
    ("1/0", "x", "division by zero"), ("9**9**9", "x", "exponent"), ("10**400", "x", "large"),
    ("6 GB", "rounds", "'GB' measures data size; this answer is in rounds"),
    ("175 ms", "MB", "'ms' measures time"), ("175 foo", "MB", "'foo' is not a unit of data size"),
    ("5 %", "rounds", "'%' measures a fraction"), ("4 * MB", "MB", "arithmetic after the unit"),
    ("2 3", "x", "not a number"), ("1" * 200, "x", "longer than"),
])
def test_unreadable_numbers_say_why(text, asked, why):
    with pytest.raises(Unreadable, match=re.escape(why)):
        read_number(text, asked)


@pytest.mark.parametrize("text", ["d", "ab", "1", "", "a b", "option a"])
def test_unreadable_letters(text):
    with pytest.raises(Unreadable):
        read_letter(text, 3)


@pytest.mark.parametrize("text", ["maybe", "", "yn"])
def test_unreadable_yes_no(text):
    with pytest.raises(Unreadable):
        read_yes_no(text)


def test_a_unit_that_names_a_measure_must_be_a_known_one():
    assert unit("MB") is UNITS["MB"] and unit("rounds").dimension == "count"
    for bad in ("", "MiB", "seconds", None):
        with pytest.raises(ValueError, match="unit"):
            unit(bad)
    with pytest.raises(ValueError, match="'no-unit'.*non-empty"):
        Numeric("no-unit", "zero", lambda rng: ("?", 1.0, ""))


# -- the sitting ---------------------------------------------------------------------------------

def _first(kind: str, topic: str | None = None, zh: bool = False):
    """A seed whose first drawn question has ``kind`` (and a source-interview line)."""
    for seed in range(1000):
        q = draw(1, topic, seed)[0]
        if q.kind == kind and (q.zh if zh else True):
            return seed, q
    raise AssertionError(f"no {kind} item drawn first")


def _run(tmp_path, capsys, seed, lines, count=1, extra=()):
    script = tmp_path / "answers.txt"
    script.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    scores = tmp_path / "scores.json"
    args = ["drill", "--count", str(count), "--seed", str(seed), "--answers", str(script),
            "--scores", str(scores), *extra]
    assert engine_main(args) == 0
    out = capsys.readouterr().out
    saved = json.loads(scores.read_text()) if scores.exists() else {}
    return out, sum(e["total"] for e in saved.values()), sum(e["right"] for e in saved.values())


def test_unreadable_numeric_answer_is_asked_again_and_not_scored(tmp_path, capsys):
    seed, q = _first("numeric")
    out, total, right = _run(tmp_path, capsys, seed, ["A)", f"{q.answer:.6g} {q.unit}"])
    assert f"could not read 'A)' ('A' is not a number): answer with a number " \
           f"{unit(q.unit).asked}, for example {example(q.unit)}." in out
    assert out.count("answer> ") == 2 and "score: 1/1" in out
    assert (total, right) == (1, 1)


@pytest.mark.parametrize("form", ["{}", "{})", "({})", "{}."])
def test_unreadable_letter_is_asked_again_then_every_form_is_read(tmp_path, capsys, form):
    seed, q = _first("choice")
    letter = chr(ord("A") + q.answer)
    out, total, right = _run(tmp_path, capsys, seed, ["1", "z", form.format(letter)])
    last = chr(ord("a") + len(q.options) - 1)
    assert f"could not read '1' (not a letter): answer with a letter from a to {last}, for " \
           "example b or (b)." in out
    assert f"could not read 'z' (there is no option z; the options are a to {last}): " in out
    assert out.count("letter> ") == 3 and "score: 1/1" in out
    assert (total, right) == (1, 1)


def test_the_original_issue_inputs_are_right(tmp_path, capsys):
    """'6 rounds', 'A)' and '4.5*1024' were marked wrong; each now reads as what it says."""
    q = next(q for q in draw(200, seed=0) if q.item_id == "ring-rounds")
    assert q.grade(f"{q.answer:g} rounds") and not q.grade(f"{2 * q.answer:g} rounds")
    choice = next(q for q in draw(200, seed=0) if q.kind == "choice")
    assert choice.grade(chr(ord("A") + choice.answer) + ")")
    assert choice.grade("(" + chr(ord("a") + choice.answer) + ")")
    numeric = next(q for q in draw(200, seed=0) if q.unit == "MB")
    assert numeric.grade(f"{numeric.answer / 1024}*1024")


def test_end_of_input_stops_the_sitting_and_only_answered_items_count(tmp_path, capsys):
    questions = draw(5, seed=3)
    first = questions[0]
    answer = [f"{first.answer:.6g}"] if first.kind == "numeric" else \
        ["(said aloud)", "y"] if first.kind == "outline" else [chr(ord("a") + first.answer)]
    out, total, right = _run(tmp_path, capsys, 3, answer, count=5)
    assert "score: 1/1 (4 of 5 skipped: the input ended; not scored)" in out
    assert "[2/5]" in out and "[3/5]" not in out  # the second is asked, the sitting stops there
    assert (total, right) == (1, 1)


def test_no_answer_at_all_saves_nothing(tmp_path, capsys):
    out, total, _ = _run(tmp_path, capsys, 3, [], count=5)
    assert "score: 0/0 (5 of 5 skipped" in out and "nothing answered: no score saved" in out
    assert not (tmp_path / "scores.json").exists() and total == 0


def test_unreadable_answers_until_the_end_are_not_scored(tmp_path, capsys):
    seed, _ = _first("numeric")
    out, total, _ = _run(tmp_path, capsys, seed, ["a guess", "?"], count=3)
    assert out.count("could not read") == 2 and "score: 0/0 (3 of 3 skipped" in out
    assert total == 0


def test_the_original_line_is_labelled_and_can_be_left_out(tmp_path, capsys):
    seed, q = _first("numeric", zh=True)
    out, _, _ = _run(tmp_path, capsys, seed, [])
    assert f"as asked in the source interview: {q.zh}" in out
    out, _, _ = _run(tmp_path, capsys, seed, [], extra=["--no-original"])
    assert q.zh not in out and "source interview" not in out and q.text in out


def test_count_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        engine_main(["drill", "--count", "0"])
    assert "--count must be a positive int, got '0'" in capsys.readouterr().err


def _read_until(stream, marker: str, after: str = "", timeout: float = 120.0) -> str:
    """Read the child's stdout until it ends with ``marker`` (a prompt has no newline),
    printed after ``after``."""
    seen = b""
    while not (seen.endswith(marker.encode()) and after.encode() in seen):
        ready, _, _ = select.select([stream], [], [], timeout)
        assert ready, f"nothing more after {seen.decode()[-300:]!r}"
        chunk = os.read(stream.fileno(), 4096)
        assert chunk, f"the drill ended before printing {marker!r}: {seen.decode()[-300:]!r}"
        seen += chunk
    return seen.decode()


def test_each_question_is_printed_before_its_answer_is_read_from_a_pipe(tmp_path):
    """With --answers -, the first question and its prompt come out while stdin is still open
    and empty; each answer gets its feedback before the next is written."""
    seed, q = _first("choice")
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "drill", "--count", "2", "--seed", str(seed),
         "--answers", "-", "--scores", str(tmp_path / "scores.json")],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        first = _read_until(proc.stdout, "letter> ")
        assert "[1/2]" in first and q.text in first
        proc.stdin.write(f"{chr(ord('a') + q.answer)})\n".encode())
        proc.stdin.flush()
        second = _read_until(proc.stdout, "> ", after="[2/2]")  # the second item's prompt
        assert "-> right" in second and "[2/2]" in second
        proc.stdin.close()  # end of input: the second item is not scored
        rest = proc.stdout.read().decode()
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
    assert "score: 1/1 (1 of 2 skipped" in rest


# -- every item of the bank ----------------------------------------------------------------------

def _question_sentence(text: str) -> str:
    """The last sentence, after any quoted claim."""
    return re.split(r"(?<=[.?!'])\s+(?=[A-Z'])", text.strip())[-1]


@pytest.mark.parametrize("item", BANK, ids=lambda i: i.item_id)
def test_every_item_states_its_question_and_its_answer_reads_back_as_right(item):
    for seed in range(5):
        q = item.draw(random.Random(seed))
        sentence = _question_sentence(q.text)
        assert sentence.endswith("?") and len(sentence.split()) >= 3, q.text
        text = q.as_text()
        assert text.count(q.text) == 1
        if q.kind == "numeric":
            asked = unit(q.unit)
            assert f"answer {asked.asked}, within {q.rel_tol * 100:g}%" in text
            typed = [show(q.answer, asked), f"{q.answer:.6g}", f"{q.answer:.6g} {q.unit}"]
            assert all(q.grade(t) for t in typed), (typed, q.answer)
            assert not q.grade(show(q.answer * 1.1 + 1, asked))
        elif q.kind == "choice":
            assert all(f"{chr(ord('a') + i)}) {o}" in text for i, o in enumerate(q.options))
            letter = chr(ord("a") + q.answer)
            assert all(q.grade(t) for t in (letter, letter.upper() + ")", f"({letter})"))
            assert not any(q.grade(chr(ord("a") + i)) for i in range(len(q.options))
                           if i != q.answer)
        else:
            assert q.grade("y") and not q.grade("n")
            assert not any(p in text for p in q.outline)  # not before the learner answered
            assert all(p in q.as_text(answered=True) for p in q.outline)


@pytest.mark.parametrize("name", ["MB", "GB", "TB", "%", "fraction"])
def test_units_with_two_common_forms_say_how_the_other_reads(name):
    """MB vs MiB, fraction vs percent: the question says which is wanted and the other form
    reads, converted."""
    other = {"MB": "MiB", "GB": "GiB", "TB": "TiB", "%": "82%", "fraction": "25%"}[name]
    assert other in UNITS[name].note


def test_the_notebook_widget_asks_again_for_what_it_cannot_read(tmp_path):
    pytest.importorskip("ipywidgets")
    from engine.viz.drill import drill_widget

    path = tmp_path / "drill.json"
    seed, q = _first("numeric")
    body, answer, buttons, result = drill_widget(count=1, seed=seed, scores_path=path).children
    check, _ = buttons.children
    answer.value = "about two hundred"
    check.click()
    assert "could not read" in result.value and not path.exists()  # not graded, not saved
    answer.value = f"{q.answer:.6g} {q.unit}"
    check.click()
    assert "right" in result.value and show(q.answer, q.unit) in result.value
    saved = json.loads(path.read_text())[q.topic]
    assert (saved["right"], saved["total"], saved["items"]) == (1, 1, {q.item_id: 1})


# -- issue 31: hedged numbers, letters with text, plain messages, outlines after the answer --------

def _first_item(item_id: str):
    """A seed whose first drawn question is the bank item ``item_id``."""
    topic = next(item.topic for item in BANK if item.item_id == item_id)
    for seed in range(5000):
        q = draw(1, topic, seed)[0]
        if q.item_id == item_id:
            return seed, q
    raise AssertionError(f"{item_id} never drawn first")


def _run_topic(tmp_path, capsys, topic, seed, lines):
    return _run(tmp_path, capsys, seed, lines, extra=["--topic", topic])


@pytest.mark.parametrize("form", ["approx {}", "~{}x", "≈ {}", "about ~{}"])
def test_hedged_answers_are_read_and_graded_in_a_sitting(tmp_path, capsys, form):
    seed, q = _first_item("ps-over-ring")  # an answer in "x"
    out, total, right = _run_topic(tmp_path, capsys, q.topic, seed, [form.format(q.answer)])
    assert "could not read" not in out and "score: 1/1" in out and (total, right) == (1, 1)


@pytest.mark.parametrize("form", ["{}) {}", "{}. {}", "({}) {}"])
def test_a_letter_with_its_option_text_is_read_in_a_sitting(tmp_path, capsys, form):
    seed, q = _first("choice")
    letter = chr(ord("a") + q.answer)
    out, total, right = _run(tmp_path, capsys, seed, [form.format(letter, q.options[q.answer])])
    assert "could not read" not in out and "score: 1/1" in out and (total, right) == (1, 1)


def test_what_cannot_be_read_is_said_in_one_plain_sentence(tmp_path, capsys):
    seed, q = _first_item("ps-over-ring")
    out, total, _ = _run_topic(tmp_path, capsys, q.topic, seed, ["xyz", f"{q.answer}"])
    assert "  could not read 'xyz' (no number in it): answer with a number as a multiple, for " \
           "example 1.5 or 1.5x.\n" in out
    assert total == 1


def test_an_outline_is_shown_only_after_the_learner_answered(tmp_path, capsys):
    from engine.drill.cli import SAY_PROMPT

    seed, q = _first("outline")
    out, total, right = _run(tmp_path, capsys, seed, ["ring, then latency", "y"])
    said = out.index(SAY_PROMPT + "ring, then latency")
    assert out.index(q.text) < said  # the question, then the learner's answer,
    assert all(out.index(point) > said for point in q.outline)  # then the outline,
    assert out.index("did you cover it (y/n)> y") > out.index(q.outline[-1])  # then y or n
    assert "score: 1/1" in out and (total, right) == (1, 1)
    (tmp_path / "again").mkdir()
    out, total, _ = _run(tmp_path / "again", capsys, seed, [])  # the input ends at once
    assert SAY_PROMPT + "(end of input)" in out
    assert not any(point in out for point in q.outline) and total == 0  # never shown, not scored
    out, total, _ = _run(tmp_path / "again", capsys, seed, ["said; the input ends before y/n"])
    assert all(point in out for point in q.outline) and total == 0  # shown, not scored


def test_a_chapter_drill_shows_an_outline_only_with_the_answer(tmp_path, capsys, monkeypatch):
    from engine.grading import drill as chapter_drill

    item = chapter_drill.Drill("ch02.what_is_dp", "what-is-dp")
    monkeypatch.setattr(chapter_drill, "drills", lambda: {item.name: item})
    q, scores = item.question(), tmp_path / "scores.json"
    chapter_drill.drill("ch02", scores=str(scores))
    chapter_drill.drill("ch02.what_is_dp", scores=str(scores))
    out = capsys.readouterr().out
    assert out.count(q.text) == 2 and not any(point in out for point in q.outline)
    chapter_drill.drill("ch02.what_is_dp", "y", scores=str(scores))
    out = capsys.readouterr().out
    assert all(point in out for point in q.outline) and "noted" in out


def test_answering_a_drill_again_replaces_its_score(tmp_path, capsys):
    from engine.grading.drill import drill, drills

    scores = str(tmp_path / "scores.json")
    q = drills()["ch01.ring_latency_steps"].question()
    for answer in (q.answer / 2, q.answer * 2, q.answer):  # wrong, wrong, right
        drill("ch01.ring_latency_steps", answer, scores=scores)
    assert "✓" in capsys.readouterr().out.splitlines()[-1]
    assert Scores(scores).data == {"collectives": {"right": 1, "total": 1}}
    drill("ch01.ring_latency_steps", q.answer / 2, scores=scores)  # and wrong again
    assert Scores(scores).data == {"collectives": {"right": 0, "total": 1}}


def test_a_sitting_repeated_does_not_inflate_the_score(tmp_path, capsys):
    seed, q = _first("numeric")
    for answer in ("0", "0", f"{q.answer}"):
        out, total, right = _run(tmp_path, capsys, seed, [answer])
    assert (total, right) == (1, 1) and "score: 1/1" in out


def test_a_score_file_of_the_old_format_loads_as_a_baseline(tmp_path):
    path = tmp_path / "scores.json"
    path.write_text(json.dumps({"collectives": {"right": 3, "total": 5},
                                "zero": {"right": 0, "total": 2}, "junk": 7}))
    scores = Scores(path)
    assert scores.data == {"collectives": {"right": 3, "total": 5},
                           "zero": {"right": 0, "total": 2}}
    assert "(includes 7 answers saved before results were kept per item" in scores.table()
    q = draw(1, "collectives", seed=0)[0]
    scores.record(q, True)
    scores.record(q, True)  # again: replaces
    scores.save()
    again = Scores(path)
    assert again.data["collectives"] == {"right": 4, "total": 6}
    assert again.items["collectives"] == {q.item_id: 1} and again.earlier["zero"]["total"] == 2
    for broken in ("[1, 2]", "{\"zero\": {\"right\": \"x\", \"total\": -1}}", "not json"):
        path.write_text(broken)
        assert Scores(path).data == {}


def test_the_notebook_widget_shows_an_outline_only_after_the_answer(tmp_path):
    pytest.importorskip("ipywidgets")
    import html

    from engine.viz.drill import drill_widget, question_text

    path = tmp_path / "drill.json"
    seed, q = _first("outline")
    assert not any(point in question_text(q) for point in q.outline)
    body, answer, buttons, result = drill_widget(count=1, seed=seed, scores_path=path).children
    check, _ = buttons.children
    assert check.description == "Show outline" and q.text in html.unescape(body.value)
    assert not any(point in html.unescape(body.value) for point in q.outline)
    answer.value = "my 30-second answer"
    check.click()  # the learner answered: now the outline, and the y/n question
    assert all(point in html.unescape(body.value) for point in q.outline)
    assert check.description == "Check" and answer.value == "" and not path.exists()
    answer.value = "maybe"
    check.click()
    assert "could not read 'maybe' (not y or n)" in html.unescape(result.value)
    answer.value = "y"
    check.click()
    assert "right" in result.value and Scores(path).data[q.topic] == {"right": 1, "total": 1}
