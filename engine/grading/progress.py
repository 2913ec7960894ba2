"""What a learner has done, kept beside the drill's scores, and what to do next.

Per exercise, ``exercises.json`` (in the folder of the drill's ``drill.json``, so
``$DRILL_SCORES`` moves both) holds the attempts whose code ran and failed, the hint level
reached and the last verdict. Both are kept per course folder: the learner's checkout uses the
learner's files, a student's submission graded with ``--root`` its own
(:func:`root_scores_path`), so one student's attempts never raise another's hints. :meth:`Attempts.record` decides which hints a report shows:

* none while the exercise is still "not implemented" or its file does not load;
* then one more level per failed attempt: 1 the idea, 2 the API to use, 3 the shape of the
  code (``Exercise.hints``), never fewer than were already shown;
* or, on request (``check(name, hint=2)``), every level up to the one asked for.

:func:`progress_table` puts it together per chapter: exercises passed, the drill's score on
the chapter's topics, and the next thing to do.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.drill.bank import Scores, scores_path
from engine.grading.chapters import drills, registry
from engine.grading.core import (BLOCKED, ERROR, HINT_IN_NOTEBOOK, HINT_LEVELS,
                                 NOT_IMPLEMENTED, NOT_LOADED,
                                 NOT_STARTED, PASSED, STUCK, WRONG, Exercise, Report)
from engine.grading.drill import CHAPTER_TOPICS
from engine.grading.learner import course_root, installed_course

ATTEMPTS_FILE = "exercises.json"
DRILL_ENOUGH = 5  # questions answered on a topic before its score says much
DRILL_GOOD = 0.8  # the share right that counts as "done"
_WORST_FIRST = (NOT_LOADED, NOT_IMPLEMENTED, BLOCKED, STUCK, ERROR, WRONG)


def verdict(report: Report) -> str:
    """One word for a report: passed, or its most basic failure (not loaded before wrong)."""
    if report.passed:
        return PASSED
    kinds = {r.kind for r in report.results if not r.passed}
    return next((kind for kind in _WORST_FIRST if kind in kinds), WRONG)


def attempts_path(scores: str | Path | None = None) -> Path:
    """``exercises.json`` beside the drill's scores (see :func:`engine.drill.bank.scores_path`)."""
    return scores_path(scores).parent / ATTEMPTS_FILE


def root_scores_path(root: str | Path | None) -> Path:
    """Where the drill's scores (and, beside them, the attempts) of course folder ``root`` are
    kept: the learner's own file for their checkout (``root`` None, or the folder the notebooks
    find), a file of its own for any other root (a student's submission graded with
    ``--root``; :func:`engine.drill.bank.scores_path`)."""
    if root is None:
        return scores_path()
    try:
        own = course_root()
    except FileNotFoundError:
        own = None
    return scores_path() if Path(root).resolve() == own else scores_path(root=root)


def check_hint_level(hint) -> int:
    """``hint`` as asked for in ``check(name, hint=...)``: None (0) or 1 to 3."""
    if hint is None:
        return 0
    if isinstance(hint, bool) or not isinstance(hint, int) or not 0 <= hint <= len(HINT_LEVELS):
        raise ValueError(f"hint must be a level from 1 to {len(HINT_LEVELS)} "
                         f"({', '.join(HINT_LEVELS)}), got {hint!r}")
    return hint


class Attempts:
    """Per exercise: ``attempts`` (failed runs of code that runs), ``hint_level`` (the highest
    shown) and ``last`` (the last verdict), saved as JSON."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else attempts_path()
        try:
            self.data = json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            self.data = {}

    def entry(self, name: str) -> dict:
        return self.data.get(name, {"attempts": 0, "hint_level": 0, "last": ""})

    def record(self, report: Report, hint: int | None = None) -> int:
        """Count ``report`` as an attempt; return how many hint levels to show with it."""
        asked = check_hint_level(hint)
        entry = self.data.setdefault(report.exercise.name, self.entry(report.exercise.name))
        entry["last"] = verdict(report)
        earned = 0
        if entry["last"] not in (PASSED, *NOT_STARTED):
            entry["attempts"] += 1
            earned = max(entry["hint_level"], min(entry["attempts"], len(HINT_LEVELS)))
        level = max(asked, earned)
        entry["hint_level"] = max(entry["hint_level"], level)
        return level

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1, sort_keys=True))


def _next_for_exercise(exercise: Exercise, entry: dict, last: str,
                       hint_command: str = HINT_IN_NOTEBOOK) -> str:
    name, file = exercise.name, f"exercises/{exercise.module}.py"
    if last in ("", NOT_IMPLEMENTED):
        return f"write {name} in {file}"
    if last == NOT_LOADED:
        shows = ("check(\"{name}\")" if hint_command == HINT_IN_NOTEBOOK
                 else "the report above").format(name=name)
        return f"make {file} load: {shows} shows the line"
    more = min(entry["hint_level"] + 1, len(HINT_LEVELS))
    tries = entry["attempts"]
    return (f"fix {name} ({tries} failed tr{'y' if tries == 1 else 'ies'}): "
            + hint_command.format(name=name, level=more))


def _drill_cell(chapter: str, scores: Scores) -> tuple[str, str]:
    """The chapter's drill score (right/asked over its topics) and, if not done, what to run."""
    topics = CHAPTER_TOPICS.get(chapter, ())
    right = sum(scores.data.get(t, {}).get("right", 0) for t in topics)
    asked = sum(scores.data.get(t, {}).get("total", 0) for t in topics)
    label = " + ".join(topics) if len(topics) < 3 else "all topics"
    shown = f"{label} {right}/{asked}" + (f" {right / asked:.0%}" if asked else "")
    if asked >= DRILL_ENOUGH and right / asked >= DRILL_GOOD:
        return shown, ""
    chapter_drills = any(name.split(".")[0] == chapter for name in drills())
    if chapter_drills:
        return shown, f"answer drill(\"{chapter}\") in the notebook"
    topic = f" --topic '{topics[0]}'" if len(topics) == 1 else ""
    return shown, f"run python -m engine drill{topic}"


def progress_table(exercises: dict[str, Exercise], last: dict[str, str], attempts: Attempts,
                   scores: Scores, titles: dict[str, str] | None = None,
                   only: list[str] | None = None, hint_command: str = HINT_IN_NOTEBOOK) -> str:
    """Per chapter: exercises passed, the drill's score on its topics, the next thing to do;
    then the first chapter's next step. ``last`` maps exercise names to their verdicts (from
    this grading run, or the saved ones). With ``only`` (the exercises graded by an ``--only``
    run) just their chapters are shown, and each chapter's next step is one of them if any is
    not passed yet."""
    titles = titles or {}
    chapters = sorted({e.chapter for e in exercises.values()} | set(CHAPTER_TOPICS))
    if only is not None:
        chapters = [c for c in chapters if any(n.split(".")[0] == c for n in only)]
    focus = set(only or ())
    rows = [("chapter", "exercises", "drill (right/asked)", "next")]
    first_step = ""
    for chapter in chapters:
        mine = [e for e in exercises.values() if e.chapter == chapter]
        passed = sum(last.get(e.name) == PASSED for e in mine)
        drill_score, drill_step = _drill_cell(chapter, scores)
        todo = next((e for e in sorted(mine, key=lambda e: e.name not in focus)
                     if last.get(e.name) != PASSED), None)
        step = (_next_for_exercise(todo, attempts.entry(todo.name), last.get(todo.name, ""),
                                   hint_command)
                if todo else drill_step) or "done"
        first_step = first_step or (step if step != "done" else "")
        name = f"{chapter} {titles.get(chapter, '')}".strip()
        rows.append((name, f"{passed}/{len(mine)}" if mine else "-", drill_score, step))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3]
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append("")
    done = ("every exercise graded passed and its chapters' drills done" if only is not None
            else "every exercise passed and every drill done")
    lines.append(f"next: {first_step}" if first_step else
                 f"next: {done}; try python -m engine drill for a mixed sitting")
    return "\n".join(lines)


def chapter_titles(root: Path | None) -> dict[str, str]:
    """``{"ch01": "collectives", ...}`` from the notebooks' names in ``<root>/course`` (a root
    without notebooks, a student's submission: the installed course's)."""
    if root is None:
        return {}
    if not (root / "course").is_dir():
        root = installed_course()
        if root is None:
            return {}
    return {f"ch{path.name[:2]}": path.stem[3:].replace("_", " ")
            for path in sorted((root / "course").glob("[0-9][0-9]_*.ipynb"))}


def saved_progress(root: Path | None = None) -> str:
    """The progress table from what was saved: the last verdict of each exercise checked
    (``check`` in a notebook, ``make grade``) and the drill's scores."""
    if root is None:
        try:
            root = course_root()
        except FileNotFoundError:
            root = None
    attempts = Attempts()
    exercises = registry()
    last = {name: attempts.entry(name)["last"] for name in exercises}
    return progress_table(exercises, last, attempts, Scores(), chapter_titles(root))


def show_progress() -> None:
    """Print :func:`saved_progress` (the chapter 00 notebook's progress cell)."""
    print(saved_progress())
