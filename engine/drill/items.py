"""Drill item types. Numeric answers are computed by :mod:`engine.theory` from randomized
parameters, never typed in; misconception items point at the chapter section whose experiment
disproves the wrong answer; outline items are self-checked against a model outline."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable

TOPICS = ("collectives", "data parallel", "compression", "zero", "tensor parallel",
          "pipeline", "3d and scale", "moe", "long context")


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

    def as_text(self, indent: str = "") -> str:
        """The question as plain text: the terminal drill, the widget and the static
        fallback all show this."""
        lines = [f"({self.topic}) {self.text}"]
        if self.zh:
            lines.append(f"{indent}原题: {self.zh}")
        if self.kind == "numeric":
            lines.append(f"{indent}(a number; within {self.rel_tol:.0%} counts)")
        if self.kind == "choice":
            lines += [f"{indent}{chr(ord('a') + i)}) {option}"
                      for i, option in enumerate(self.options)]
        if self.kind == "outline":
            lines.append(f"{indent}Say your 30-second answer, then compare with the outline:")
            lines += [f"{indent}- {point}" for point in self.outline]
        return "\n".join(lines)

    def grade(self, response) -> bool:
        """Numeric: within ``rel_tol`` (relative) of the answer. Choice: the option's index
        (0-based) or its letter. Outline: the learner's own yes/no after reading the outline."""
        if self.kind == "numeric":
            try:
                value = float(response)
            except (TypeError, ValueError):
                return False
            return math.isclose(value, float(self.answer), rel_tol=self.rel_tol,
                                abs_tol=1e-12)
        if self.kind == "choice":
            if isinstance(response, str) and len(response.strip()) == 1 \
                    and response.strip().isalpha():
                response = ord(response.strip().lower()) - ord("a")
            try:
                return int(response) == self.answer
            except (TypeError, ValueError):
                return False
        return str(response).strip().lower() in ("y", "yes", "1", "true")


@dataclass(frozen=True)
class Numeric:
    item_id: str
    topic: str
    make: Callable[[random.Random], tuple[str, float, str]]  # -> (text, answer, explanation)
    rel_tol: float = 0.01
    zh: str | None = None

    def draw(self, rng: random.Random) -> Question:
        text, answer, explanation = self.make(rng)
        return Question(self.item_id, self.topic, "numeric", text, self.zh, answer=answer,
                        rel_tol=self.rel_tol, explanation=explanation)


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
