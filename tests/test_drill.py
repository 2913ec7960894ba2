"""The interview drill: a bank of at least 80 computed, checked items, evidence that resolves,
and a terminal session that runs from a script."""

from __future__ import annotations

import json
import random
from pathlib import Path

import nbformat
import pytest

from engine.__main__ import main as engine_main
from engine.drill import BANK, TOPICS, Scores, by_topic, draw
from engine.drill.items import Choice, Numeric, Outline

ROOT = Path(__file__).resolve().parents[1]


def test_the_bank_has_at_least_80_items_over_every_topic():
    assert len(BANK) >= 80
    assert len({item.item_id for item in BANK}) == len(BANK)
    counts = by_topic()
    assert set(counts) == set(TOPICS) and all(n >= 5 for n in counts.values())
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
    assert engine_main([]) == 2
