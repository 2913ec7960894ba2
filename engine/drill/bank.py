"""The drill bank, sessions and saved scores.

``BANK`` holds every item; :func:`draw` picks questions (optionally by topic) with fresh
random parameters; :class:`Scores` keeps the latest result of each item in a JSON file
(``$DRILL_SCORES`` or ``~/.cache/distributed-course/drill.json``) so progress shows from one
sitting to the next: a topic's score is the share of its items last answered right, and
answering an item again replaces its result instead of adding one.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

from engine.drill import long_context, moe_frontier, precision, slow_links, zero_bubble
from engine.drill.choice import CHOICE
from engine.drill.items import TOPICS, Question
from engine.drill.numeric import NUMERIC
from engine.drill.outline import OUTLINE

# The first bank, then the items of the later rounds, one module per subject.
BANK = (NUMERIC + CHOICE + OUTLINE + zero_bubble.ITEMS + long_context.ITEMS + moe_frontier.ITEMS
        + slow_links.ITEMS + precision.ITEMS)


KINDS = ("numeric", "choice", "outline")


def by_topic() -> dict[str, int]:
    return {topic: sum(item.topic == topic for item in BANK) for topic in TOPICS}


def by_kind(topic: str | None = None) -> dict[str, int]:
    """Items per kind (numeric, choice, outline), in ``topic`` or in the whole bank."""
    return {kind: sum(_kind(item) == kind and topic in (None, item.topic) for item in BANK)
            for kind in KINDS}


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


def scores_path(path: str | Path | None = None, root: str | Path | None = None) -> Path:
    """Where the learner's scores live: ``path``, else ``$DRILL_SCORES``, else
    ``~/.cache/distributed-course/drill.json``. The grader keeps its attempts beside it.

    With ``root`` (a course folder graded by ``python -m engine.grading --root``, a student's
    submission), that root's own file: ``roots/<folder>-<hash of its path>/drill.json`` beside
    the learner's, so two roots never share scores or hints."""
    default = Path.home() / ".cache" / "distributed-course" / "drill.json"
    mine = Path(path or os.environ.get("DRILL_SCORES") or default)
    if path or root is None:
        return mine
    folder = Path(root).resolve()
    key = hashlib.sha1(str(folder).encode()).hexdigest()[:10]
    return mine.parent / "roots" / f"{folder.name}-{key}" / "drill.json"


class Scores:
    """The latest result of each item, by topic, saved as JSON.

    The file maps each topic to ``{"right", "total", "items", "earlier"}``: ``items`` holds each
    answered item's latest result (1 right, 0 not), ``earlier`` the right/total counts of a file
    written before results were kept per item (such a file loads as that baseline), and
    ``right``/``total`` are the two added, kept in the file for whoever reads it."""

    def __init__(self, path: str | Path | None = None):
        self.path = scores_path(path)
        try:
            saved = json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            saved = {}
        self.items: dict[str, dict[str, int]] = {}
        self.earlier: dict[str, dict[str, int]] = {}
        for topic, entry in (saved.items() if isinstance(saved, dict) else ()):
            if not isinstance(entry, dict):
                continue
            if isinstance(entry.get("items"), dict):  # per item
                self.items[topic] = {str(k): int(bool(v)) for k, v in entry["items"].items()}
                baseline = entry.get("earlier") or {}
            else:  # the format of before: counts only
                baseline = entry
            right, total = _count(baseline.get("right")), _count(baseline.get("total"))
            if total:
                self.earlier[topic] = {"right": min(right, total), "total": total}

    def record(self, question: Question, correct: bool) -> None:
        """``question``'s item was answered (right or not): replaces its earlier result."""
        self.items.setdefault(question.topic, {})[question.item_id] = int(bool(correct))

    def counts(self, topic: str) -> tuple[int, int]:
        """``(right, total)`` in ``topic``: items last answered right, items answered, each
        plus the earlier baseline."""
        items = self.items.get(topic, {})
        earlier = self.earlier.get(topic, {"right": 0, "total": 0})
        return sum(items.values()) + earlier["right"], len(items) + earlier["total"]

    @property
    def data(self) -> dict[str, dict[str, int]]:
        """``{topic: {"right", "total"}}`` for every topic with an answer."""
        counts = {topic: self.counts(topic) for topic in {*self.items, *self.earlier}}
        return {topic: {"right": right, "total": total}
                for topic, (right, total) in counts.items() if total}

    def save(self) -> None:
        out = {}
        for topic, counts in self.data.items():
            out[topic] = {**counts, "items": dict(sorted(self.items.get(topic, {}).items()))}
            if topic in self.earlier:
                out[topic]["earlier"] = self.earlier[topic]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(out, indent=1))

    def table(self) -> str:
        width = max(len(topic) for topic in TOPICS) + 2
        lines = [f"{'topic':<{width}}{'right':>7}{'asked':>7}{'score':>8}"]
        for topic in TOPICS:
            right, total = self.counts(topic)
            score = f"{right / total:.0%}" if total else "-"
            lines.append(f"{topic:<{width}}{right:>7}{total:>7}{score:>8}")
        earlier = sum(e["total"] for e in self.earlier.values())
        if earlier:
            lines.append(f"(includes {earlier} answers saved before results were kept per item; "
                         "each answer counts there, repeats too)")
        return "\n".join(lines)


def _count(value) -> int:
    """A saved count, or 0 when it is missing or not a non-negative whole number."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
