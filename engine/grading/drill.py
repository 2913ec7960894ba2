"""The chapter drills: questions from the interview drill's computed bank (:mod:`engine.drill`).

Each chapter lists its drills in ``DRILLS`` (``engine/grading/chapters/chNN.py``) as a name and
a bank item; the numbers in the question and its answer are computed by the item from a fixed
draw, never typed. Answers are read as the terminal drill reads them (``"175 MB"``,
``"2*7/8*100"``, a letter for a choice) and scored in the same file as
``python -m engine drill``, by topic.

    drill("ch01")                       # the chapter's questions
    drill("ch01.ring_rounds", "126")    # prints right or not, and why; the score is saved
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from engine.drill.answers import Unreadable
from engine.drill.bank import BANK, Scores
from engine.drill.cli import feedback
from engine.drill.items import TOPICS, Question
from engine.grading.chapters import drills  # every chapter's DRILLS, by name

# The drill topics each chapter teaches (chapter 08 is the whole drill).
CHAPTER_TOPICS: dict[str, tuple[str, ...]] = {
    "ch00": ("collectives",), "ch01": ("collectives",), "ch02": ("data parallel",),
    "ch03": ("compression",), "ch04": ("zero",), "ch05": ("tensor parallel",),
    "ch06": ("pipeline",), "ch07": ("3d and scale",), "ch08": TOPICS,
    "ch09": ("long context",), "ch10": ("moe",), "ch11": ("slow links and failures",),
    "ch12": ("precision and memory",),
}
_ITEMS = {item.item_id: item for item in BANK}


@dataclass(frozen=True)
class Drill:
    """``name`` ("ch01.ring_rounds") asks bank item ``item`` ("ring-rounds") as drawn with
    ``seed``: the same question, with its computed answer, every time."""

    name: str
    item: str
    seed: int = 0

    def __post_init__(self):
        if self.item not in _ITEMS:
            raise ValueError(f"drill {self.name!r}: no bank item {self.item!r} in engine.drill")
        chapter = self.name.split(".")[0]
        if chapter in CHAPTER_TOPICS and _ITEMS[self.item].topic not in CHAPTER_TOPICS[chapter]:
            raise ValueError(f"drill {self.name!r}: bank item {self.item!r} is about "
                             f"{_ITEMS[self.item].topic!r}, not {CHAPTER_TOPICS[chapter]}")

    def question(self) -> Question:
        return _ITEMS[self.item].draw(random.Random(self.seed))


def _get(name: str) -> Drill:
    known = drills()
    if name not in known:
        raise ValueError(f"no drill named {name!r}; known drills: {', '.join(known)}")
    return known[name]


def grade_drill(name: str, answer) -> bool | None:
    """True/False for an answer; None when it is not answered yet. Raises ValueError saying
    what to type when the answer cannot be read."""
    question = _get(name).question()
    if answer is None:
        return None
    try:
        question.read(answer)
    except Unreadable as e:
        how = question.how_to_answer().removeprefix("answer ")
        raise ValueError(f"answer drill {name!r} {how}; could not read {answer!r} ({e})") \
            from None
    return question.grade(answer)


def _how(name: str, question: Question) -> str:
    example = {"numeric": "a number", "choice": "a letter", "outline": "'y' or 'n'"}
    return f"answer: drill(\"{name}\", {example[question.kind]})"


def drill(name: str, answer=None, scores: str | None = None) -> None:
    """A chapter (``"ch01"``): print its questions. A drill (``"ch01.ring_rounds"``): print
    the question, and once answered whether ``answer`` is right and why; the answer is scored
    under the question's topic, with the terminal drill's scores (``scores``: another file)."""
    if "." not in name:
        mine = {n: d for n, d in drills().items() if n.split(".")[0] == name}
        if not mine:
            raise ValueError(f"no drills for chapter {name!r}; chapters with drills: "
                             f"{', '.join(sorted({n.split('.')[0] for n in drills()}))}")
        for drill_name, item in mine.items():
            question = item.question()
            print(f"{drill_name}: {question.as_text(indent='    ', original=False)}")
            print(f"    {_how(drill_name, question)}\n")
        return
    verdict = grade_drill(name, answer)  # raises on an unknown name or an unreadable answer
    question = _get(name).question()
    print(question.as_text(indent="    ", original=False, answered=verdict is not None))
    if verdict is None:
        print(f"    (not answered yet; {_how(name, question)})")
        return
    saved = Scores(scores)
    saved.record(question, verdict)
    saved.save()
    mark = "\033[32m✓\033[0m" if verdict else "\033[31m✗\033[0m"
    print(f"{mark}{feedback(question, verdict, question.read(answer))}")
