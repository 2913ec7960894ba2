"""The interview drill: a bank of computed, checked items (at least 15 per topic), evidence that
resolves, a terminal session that runs from a script, and one count of items everywhere."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip(
    "nbformat", reason="reads the course notebooks; nbformat is not installed here")

from engine.__main__ import main as engine_main
from engine.drill import BANK, TOPICS, Scores, by_topic, draw
from engine.drill.bank import by_kind
from engine.drill.items import Choice, Numeric, Outline

ROOT = Path(__file__).resolve().parents[1]


def test_the_bank_has_at_least_80_items_over_every_topic():
    assert len(BANK) >= 80
    assert len({item.item_id for item in BANK}) == len(BANK)
    counts = by_topic()
    assert set(counts) == set(TOPICS)


@pytest.mark.parametrize("topic", TOPICS)
def test_every_topic_has_at_least_15_items(topic):
    """Issue 31: one sitting of a topic (ten questions) must not exhaust it."""
    assert by_topic()[topic] >= 15, by_kind(topic)
    assert len(draw(15, topic=topic, seed=0)) >= 15
    assert sum(isinstance(i, Numeric) for i in BANK) >= 30
    assert sum(isinstance(i, Choice) for i in BANK) >= 17 + 6  # NOTES items + documents' traps


@pytest.mark.parametrize("item", [i for i in BANK if isinstance(i, Numeric)],
                         ids=lambda i: i.item_id)
def test_numeric_answers_are_computed_from_drawn_parameters(item):
    answers = set()
    for seed in range(40):
        q = item.draw(random.Random(seed))
        assert q.grade(q.answer) and q.grade(str(q.answer))
        assert not q.grade(q.answer * 1.1 + 1) and not q.grade("a guess")
        answers.add((q.text, round(float(q.answer), 9)))
    assert len(answers) >= 2  # new parameters, new answer: nothing typed in


@pytest.mark.parametrize("item", [i for i in BANK if isinstance(i, Choice)],
                         ids=lambda i: i.item_id)
def test_choice_items_grade_only_the_right_option(item):
    q = item.draw(random.Random(0))
    assert q.options[q.answer] == item.options[item.answer]
    assert q.grade(q.answer) and q.grade(chr(ord("a") + q.answer))
    assert not any(q.grade(i) for i in range(len(q.options)) if i != q.answer)


def _sections(notebook: str) -> set[str]:
    nb = nbformat.read(ROOT / notebook, as_version=4)
    return {line[3:].strip() for cell in nb.cells if cell.cell_type == "markdown"
            for line in cell.source.splitlines() if line.startswith("## ")}


@pytest.mark.parametrize("item", [i for i in BANK if getattr(i, "evidence", None)],
                         ids=lambda i: i.item_id)
def test_every_evidence_link_resolves_to_a_notebook_section(item):
    notebook, heading = item.evidence
    assert heading in _sections(notebook), f"{notebook} has no section {heading!r}"


def test_every_follow_up_of_both_documents_is_drilled_with_its_chinese_question():
    seeds = ROOT.parent / "shared" / "seeds"
    if not seeds.exists():
        pytest.skip("the source documents are not next to this checkout")
    questions = set()
    for doc in seeds.glob("0*.txt"):
        for line in doc.read_text(encoding="utf-8").splitlines():
            if line.startswith("追问"):
                questions.add(line.split("：", 1)[1].strip())
    drilled = {item.zh for item in BANK if item.zh}
    for question in questions:
        assert any(question in zh or zh in question for zh in drilled), question
    assert all(isinstance(i, Outline) for i in BANK if i.item_id.startswith("fu-"))


def test_draw_filters_by_topic_and_rejects_unknown_ones():
    qs = draw(50, topic="pipeline", seed=1)
    assert qs and {q.topic for q in qs} == {"pipeline"}
    with pytest.raises(ValueError, match="unknown topic 'sharding'"):
        draw(5, topic="sharding")


def test_the_terminal_drill_runs_from_a_script_and_keeps_scores(tmp_path, capsys):
    scores = tmp_path / "scores.json"
    questions = draw(6, seed=7)
    answers = []
    for q in questions:
        if q.kind == "numeric":
            answers.append(str(q.answer))
        elif q.kind == "choice":
            answers.append(chr(ord("a") + q.answer))
        else:
            answers += ["(my 30-second answer)", "y"]  # said, then y or n after the outline
    script = tmp_path / "answers.txt"
    script.write_text("\n".join(answers), encoding="utf-8")
    args = ["drill", "--count", "6", "--seed", "7", "--answers", str(script), "--scores",
            str(scores)]
    assert engine_main(args) == 0
    assert "score: 6/6" in capsys.readouterr().out
    wrong = []
    for q in questions:
        wrong += ["0"] if q.kind == "numeric" else ["", "n"] if q.kind == "outline" \
            else [chr(ord("a") + (q.answer + 1) % len(q.options))]
    script.write_text("\n".join(wrong), encoding="utf-8")  # the same items, all wrong now
    engine_main(args)
    out = capsys.readouterr().out
    assert "score: 0/6" in out
    saved = json.loads(scores.read_text())
    assert sum(e["total"] for e in saved.values()) == 6  # the latest result of each item
    assert sum(e["right"] for e in saved.values()) == 0
    assert "all sittings so far" in out
    assert Scores(scores).table().count("\n") == len(TOPICS)


def test_listing_the_bank(capsys):
    assert engine_main(["drill", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(topic in out for topic in TOPICS)
    kinds = by_kind()
    assert sum(kinds.values()) == len(BANK) == sum(by_topic().values())
    assert re.search(rf"in all\s+{len(BANK)} items: {kinds['numeric']} numeric, "
                     rf"{kinds['choice']} misconceptions, {kinds['outline']} outlines\n", out)
    for topic in TOPICS:
        n = by_kind(topic)
        assert re.search(rf"{topic}\s+{by_topic()[topic]} items: {n['numeric']} numeric, "
                         rf"{n['choice']} misconception", out)
    assert engine_main([]) == 2


def test_the_readmes_state_the_banks_counts():
    """The counts README.md and the course map type are the bank's (python -m engine drill
    --list prints them): one number everywhere."""
    kinds = by_kind()
    line = next(line for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
                if "python -m engine drill`: the interview drill" in line)
    found = re.search(r"(\d+) items \(at least (\d+) per topic.*?\): (\d+) numeric .*?, "
                      r"(\d+) misconceptions .*?, (\d+) thirty-second outlines", line)
    assert found, line
    total, floor, numeric, choice, outline = (int(g) for g in found.groups())
    assert (total, numeric, choice, outline) == \
        (len(BANK), kinds["numeric"], kinds["choice"], kinds["outline"])
    assert min(by_topic().values()) >= floor
    course_map = next(line for line in (ROOT / "course" / "README.md").read_text(
        encoding="utf-8").splitlines() if "08_interview_drill.ipynb" in line)
    assert re.findall(r"(\d+) items", course_map) == [str(len(BANK))], course_map
