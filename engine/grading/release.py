"""``python -m engine.grading release --out DIR``: the course a student gets.

The student's copy holds the notebooks, the exercises' stubs, the engine (its grader included)
and the tests a learner can run, and nothing of ``solutions/``: no reference file, no test that
reads one, no git history (where the solutions are). The grader needs none of them: every check
computes its reference in the grader's process from the engine's own implementation (switched
off only where the learner's code runs, :mod:`engine.grading.worker`), so ``check(...)`` in a
notebook and ``python -m engine.grading`` grade every exercise in the release as in the
instructor's course.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

LEFT_OUT_DIRS = {"solutions", ".git", ".venv", "build", "test-artifacts", "__pycache__",
                 ".pytest_cache", "node_modules"}
TESTS_THAT_NEED_SOLUTIONS = "solutions"  # a test whose text names the folder is left out


def _tracked(course: Path) -> list[Path]:
    """The files git tracks (a checkout), else every file under ``course``."""
    if (course / ".git").exists() and shutil.which("git"):
        done = subprocess.run(["git", "-C", str(course), "ls-files", "-z"],
                              capture_output=True, check=False)
        if done.returncode == 0:
            return [course / name for name in done.stdout.decode().split("\0") if name]
    return [p for p in course.rglob("*") if p.is_file()]


def left_out(relative: Path, text: str | None) -> str:
    """Why ``relative`` stays out of the release ("" when it goes in)."""
    if LEFT_OUT_DIRS & set(relative.parts):
        return f"{next(iter(LEFT_OUT_DIRS & set(relative.parts)))}/"
    if relative.parts[0] == "tests" and text is not None and TESTS_THAT_NEED_SOLUTIONS in text:
        return "a test that reads solutions/"
    return ""


def write_release(course: Path, out: Path) -> dict[str, list[str]]:
    """Copy ``course`` into ``out`` without the solutions; what was copied and left out."""
    course, out = course.resolve(), out.resolve()
    if out == course or out.is_relative_to(course) and "solutions" in out.parts:
        raise ValueError(f"--out {out} must not be inside the course's solutions")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out} exists and is not empty: give a new folder")
    copied, skipped = [], []
    for path in sorted(_tracked(course)):
        relative = path.relative_to(course)
        if not path.is_file() or (out.is_relative_to(course) and
                                  path.is_relative_to(out)):
            continue
        text = None
        if relative.parts[0] == "tests" and path.suffix == ".py":
            text = path.read_text(errors="replace")
        why = left_out(relative, text)
        if why:
            skipped.append(f"{relative} ({why})")
            continue
        target = out / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
        copied.append(str(relative))
    return {"copied": copied, "left out": skipped}
