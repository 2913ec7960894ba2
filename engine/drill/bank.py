"""The drill bank, sessions and saved scores.

``BANK`` holds every item; :func:`draw` picks questions (optionally by topic) with fresh
random parameters; :class:`Scores` keeps per-topic results in a JSON file
(``$DRILL_SCORES`` or ``~/.cache/distributed-course/drill.json``) so progress shows from one
sitting to the next.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from engine.drill.choice import CHOICE
from engine.drill.items import TOPICS, Question
from engine.drill.numeric import NUMERIC
from engine.drill.outline import OUTLINE

BANK = NUMERIC + CHOICE + OUTLINE


def by_topic() -> dict[str, int]:
    return {topic: sum(item.topic == topic for item in BANK) for topic in TOPICS}


def draw(count: int = 10, topic: str | None = None, seed: int | None = None,
         kinds: tuple[str, ...] = ("numeric", "choice", "outline")) -> list[Question]:
    """``count`` questions (without repeating an item), from ``topic`` or all topics."""
    if topic is not None and topic not in TOPICS:
        raise ValueError(f"unknown topic {topic!r}; choose one of {', '.join(TOPICS)}")
    rng = random.Random(seed)
    pool = [item for item in BANK if (topic is None or item.topic == topic)
            and _kind(item) in kinds]
    rng.shuffle(pool)
    return [item.draw(rng) for item in pool[:count]]


def _kind(item) -> str:
    return {"Numeric": "numeric", "Choice": "choice", "Outline": "outline"}[type(item).__name__]


def scores_path(path: str | Path | None = None) -> Path:
    """Where the learner's scores live: ``path``, else ``$DRILL_SCORES``, else
    ``~/.cache/distributed-course/drill.json``. The grader keeps its attempts beside it."""
    default = Path.home() / ".cache" / "distributed-course" / "drill.json"
    return Path(path or os.environ.get("DRILL_SCORES") or default)


class Scores:
    """Right and total per topic, saved as JSON."""

    def __init__(self, path: str | Path | None = None):
        self.path = scores_path(path)
        try:
            self.data = json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            self.data = {}

    def record(self, question: Question, correct: bool) -> None:
        entry = self.data.setdefault(question.topic, {"right": 0, "total": 0})
        entry["total"] += 1
        entry["right"] += int(correct)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1))

    def table(self) -> str:
        lines = [f"{'topic':<18}{'right':>7}{'asked':>7}{'score':>8}"]
        for topic in TOPICS:
            entry = self.data.get(topic, {"right": 0, "total": 0})
            score = f"{entry['right'] / entry['total']:.0%}" if entry["total"] else "-"
            lines.append(f"{topic:<18}{entry['right']:>7}{entry['total']:>7}{score:>8}")
        return "\n".join(lines)
