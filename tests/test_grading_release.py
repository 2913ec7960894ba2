"""``python -m engine.grading release --out DIR``: the course a student gets holds no file of
the reference solutions (nor their text under another name), and its grader still grades every
exercise: with the solutions typed into the release's own ``exercises/`` (as a student who
solved everything would have them), every check of every exercise passes, graded in the
release's own engine, which has no ``solutions/`` to read from."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.grading import registry
from engine.grading.__main__ import main as grade_main

ROOT = Path(__file__).resolve().parent.parent
# Grading all 36 exercises in forked workers takes about 2 minutes on 2 cores.
pytestmark = pytest.mark.timeout(900)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("release") / "course"
    assert grade_main(["release", "--out", str(out), "--course", str(ROOT)]) == 0
    return out


def test_the_release_holds_no_solution(release):
    assert not (release / "solutions").exists()
    references = {_digest(p) for p in (ROOT / "solutions").glob("*.py")
                  if p.name != "__init__.py"}
    shipped = [p for p in release.rglob("*") if p.is_file()]
    assert not [p for p in shipped if _digest(p) in references]
    assert not (release / ".git").exists()
    tests = [p.name for p in (release / "tests").glob("test_*.py")]
    assert "test_structure.py" in tests and "test_grading.py" not in tests
    assert all("solutions" not in (release / "tests" / t).read_text() for t in tests)
    for name in ("course", "exercises", "engine", "README.md", "Makefile"):
        assert (release / name).exists(), name


def test_a_release_into_a_folder_that_is_not_empty_is_refused(tmp_path, capsys):
    (tmp_path / "kept.txt").write_text("mine")
    with pytest.raises(SystemExit):
        grade_main(["release", "--out", str(tmp_path), "--course", str(ROOT)])
    assert "exists and is not empty" in capsys.readouterr().err


def test_the_releases_grader_grades_every_exercise_without_solutions(release, tmp_path):
    student = tmp_path / "course"
    shutil.copytree(release, student)
    for exercise in registry().values():
        shutil.copy(ROOT / "solutions" / f"{exercise.module}.py",
                    student / "exercises" / f"{exercise.module}.py")
    env = {**os.environ, "PYTHONPATH": str(student), "DRILL_SCORES": str(tmp_path / "d.json")}
    done = subprocess.run([sys.executable, "-m", "engine.grading", "--fresh", "--sandbox",
                           "none", "--timeout", "60"], cwd=student, env=env, text=True,
                          capture_output=True, stdin=subprocess.DEVNULL, timeout=840)
    out = done.stdout + done.stderr
    engine_used = subprocess.run([sys.executable, "-c", "import engine; print(engine.__file__)"],
                                 cwd=student, env=env, text=True, capture_output=True)
    assert engine_used.stdout.strip() == str(student / "engine" / "__init__.py")
    total = len(registry())
    assert done.returncode == 0, out[-4000:]
    assert f"{total}/{total} exercises" in out, out[-4000:]
