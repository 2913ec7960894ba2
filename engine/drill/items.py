"""Drill item types. Numeric answers are computed by :mod:`engine.theory` from randomized
parameters, never typed in; misconception items point at the chapter section whose experiment
disproves the wrong answer; outline items are self-checked against a model outline."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable

from engine.drill import answers

TOPICS = ("collectives", "data parallel", "compression", "zero", "tensor parallel",
          "pipeline", "3d and scale", "moe", "long context", "slow links and failures",
          "precision and memory")


@dataclass(frozen=True)
class Question:
    """One drawn question, ready to show and grade."""

    item_id: str
    topic: str
    kind: str  # "numeric" | "choice" | "outline"
    text: str
    zh: str | None = None
    options: tuple[str, ...] = ()
    answer: float | int | None = None
    rel_tol: float = 0.01
    explanation: str = ""
    evidence: tuple[str, str] | None = None  # (notebook, section heading)
    outline: tuple[str, ...] = ()
    unit: str = ""  # numeric: the unit asked for (see engine.drill.answers.UNITS)

    def as_text(self, indent: str = "", original: bool = True, answered: bool = False) -> str:
        """The question as plain text: the terminal drill, the widget, the chapter drills and
        the static fallback all show this. ``original=False`` leaves out the source interview's
        wording. An outline item's outline is left out until the learner has answered
        (``answered=True`` adds :meth:`reveal`), so that it cannot prompt the answer."""
        lines = [f"({self.topic}) {self.text}"]
        if self.zh and original:
            lines.append(f"{indent}as asked in the source interview: {self.zh}")
        if self.kind == "numeric":
            asked = answers.unit(self.unit)
            note = f" ({asked.note})" if asked.note else ""
            lines.append(f"{indent}answer {asked.asked}, within {self.rel_tol * 100:g}%{note}")
        if self.kind == "choice":
            lines += [f"{indent}{chr(ord('a') + i)}) {option}"
                      for i, option in enumerate(self.options)]
        if self.kind == "outline":
            lines.append(f"{indent}Say your 30-second answer first; the outline comes after.")
            if answered:
                lines.append(self.reveal(indent))
        return "\n".join(lines)

    def reveal(self, indent: str = "") -> str:
        """An outline item's outline, shown once the learner has said an answer."""
        if self.kind != "outline":
            return ""
        return "\n".join([f"{indent}Compare your answer with the outline:"]
                         + [f"{indent}- {point}" for point in self.outline])

    def how_to_answer(self) -> str:
        """What to type, with an example: the end of the drill's "could not read" sentence."""
        if self.kind == "numeric":
            asked = answers.unit(self.unit)
            return f"answer with a number {asked.asked}, for example {answers.example(asked)}"
        if self.kind == "choice":
            last = chr(ord("a") + len(self.options) - 1)
            return f"answer with a letter from a to {last}, for example b or (b)"
        return "answer y if your answer covered the outline, n if it did not"

    def unreadable(self, response, error: Exception | str) -> str:
        """One sentence saying what could not be read, why, and what to type instead."""
        return f"could not read {response!r} ({error}): {self.how_to_answer()}."

    def read(self, response):
        """The answer in ``response`` (typed text, or a number/index/bool): a value in the
        item's unit, an option's 0-based index, or yes/no. Raises
        :class:`engine.drill.answers.Unreadable` for text it cannot read."""
        if not isinstance(response, str):
            if self.kind == "outline" and isinstance(response, bool):
                return response
            if self.kind != "outline" and isinstance(response, (int, float)) \
                    and not isinstance(response, bool):
                return response
            raise answers.Unreadable(f"{response!r} is not an answer")
        if self.kind == "numeric":
            return answers.read_number(response, self.unit)
        if self.kind == "choice":
            return answers.read_letter(response, len(self.options))
        return answers.read_yes_no(response)

    def grade(self, response) -> bool:
        """Numeric: within ``rel_tol`` (relative) of the answer, in the asked unit. Choice: the
        option's letter (or 0-based index). Outline: the learner's own yes/no after reading the
        outline. An answer :meth:`read` cannot read is not right (the terminal drill asks
        again instead of grading it)."""
        try:
            value = self.read(response)
        except answers.Unreadable:
            return False
        if self.kind == "numeric":
            return math.isclose(value, float(self.answer), rel_tol=self.rel_tol,
                                abs_tol=1e-12)
        if self.kind == "choice":
            return value == self.answer
        return value


@dataclass(frozen=True)
class Numeric:
    item_id: str
    topic: str
    make: Callable[[random.Random], tuple[str, float, str]]  # -> (text, answer, explanation)
    rel_tol: float = 0.01
    zh: str | None = None
    unit: str = ""  # what the answer is in: "MB", "%", "fraction", "rounds" (answers.UNITS)

    def __post_init__(self):
        try:
            answers.unit(self.unit)
        except ValueError as e:
            raise ValueError(f"numeric drill item {self.item_id!r}: {e}") from None

    def draw(self, rng: random.Random) -> Question:
        text, answer, explanation = self.make(rng)
        return Question(self.item_id, self.topic, "numeric", text, self.zh, answer=answer,
                        rel_tol=self.rel_tol, explanation=explanation, unit=self.unit)


@dataclass(frozen=True)
class Choice:
    item_id: str
    topic: str
    text: str
    options: tuple[str, ...]
    answer: int
    explanation: str
    evidence: tuple[str, str]
    zh: str | None = None

    def draw(self, rng: random.Random) -> Question:
        order = list(range(len(self.options)))
        rng.shuffle(order)
        return Question(self.item_id, self.topic, "choice", self.text, self.zh,
                        options=tuple(self.options[i] for i in order),
                        answer=order.index(self.answer), explanation=self.explanation,
                        evidence=self.evidence)


@dataclass(frozen=True)
class Outline:
    item_id: str
    topic: str
    text: str
    outline: tuple[str, ...]
    zh: str | None = None
    evidence: tuple[str, str] | None = None
    extra: dict = field(default_factory=dict)

    def draw(self, rng: random.Random) -> Question:
        return Question(self.item_id, self.topic, "outline", self.text, self.zh,
                        outline=self.outline, evidence=self.evidence,
                        explanation="Compare your answer with the outline, point by point.")
