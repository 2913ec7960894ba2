"""Grading a class (issue 31): ``python -m engine.grading --root students/alice`` on a folder
holding only ``exercises/``; an endless loop fails its own exercise within the time limit and
the others are graded; the junit names the student and survives a stopped run; each root keeps
its own hints and drill scores; ``--only`` and ``--hint`` shape what is printed.

Fast on purpose: a few exercises (``--only``) and a time limit of a few seconds.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from datetime import datetime
from pathlib import Path

import pytest

from engine.drill.bank import Scores, scores_path
from engine.grading import run_checks
from engine.grading.__main__ import main as grade_main
from engine.grading.isolated import DEFAULT_TIMEOUT_S, SLOWEST_SOLUTION_S, run_isolated
from engine.grading.progress import Attempts, attempts_path, root_scores_path
from tests.helpers import default_sigint

ROOT = Path(__file__).resolve().parent.parent
LOOP = "def merge(out_1, lse_1, out_2, lse_2):\n    while True:  # lines 2 and 3\n        pass\n"
ZIGZAG_LOOP = "def zigzag_indices(seq_len, n, rank):\n    while True:\n        pass\n"
BY_T = '''import torch


def load_balancing_loss(probs, expert, alpha=0.01):
    experts = probs.shape[-1]
    f = torch.bincount(expert.reshape(-1), minlength=experts).to(probs.dtype) / probs.shape[0]
    return alpha * experts * (f * probs.mean(dim=0)).sum()
'''


@pytest.fixture(autouse=True)
def _learner_state_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("DRILL_SCORES", str(tmp_path / "learner" / "drill.json"))


def _submission(folder: Path, files: dict[str, str]) -> Path:
    """A student's folder: ``exercises/`` and nothing else; a value "solution" copies the
    reference."""
    (folder / "exercises").mkdir(parents=True)
    for module, source in files.items():
        if source == "solution":
            source = (ROOT / "solutions" / f"{module}.py").read_text()
        (folder / "exercises" / f"{module}.py").write_text(source)
    return folder


def test_the_default_time_limit_is_a_little_over_the_slowest_solution():
    assert SLOWEST_SOLUTION_S < DEFAULT_TIMEOUT_S <= 4 * SLOWEST_SOLUTION_S


def test_an_endless_loop_fails_its_exercise_in_time_and_the_others_are_graded(tmp_path,
                                                                             capsys):
    alice = _submission(tmp_path / "alice", {"ch09_online_softmax": LOOP,
                                             "ch09_zigzag_indices": "solution"})
    xml = tmp_path / "alice.xml"
    start = time.monotonic()
    code = grade_main(["--root", str(alice), "--only", "ch09.online_softmax,ch09.zigzag_indices",
                       "--timeout", "5", "--junit", str(xml)])
    assert code == 1 and time.monotonic() - start < 40  # 5 s, plus the other exercise
    out = capsys.readouterr().out
    assert "took longer than 5 s" in out
    assert re.search(r"ch09_online_softmax.py, line [23], in merge", out)  # where it loops
    assert "PASS ch09.zigzag_indices: 3/3" in out
    assert "alice: 3/6 checks passed" in out and "grading alice (" in out
    suites = ET.parse(xml).getroot()
    cases = suites.findall("./testsuite/testcase")
    assert len(cases) == 6  # every check of both exercises, the looping ones included
    failed = {c.get("classname") for c in cases if c.find("failure") is not None}
    assert failed == {"ch09.online_softmax"}
    suite = suites.find("testsuite")
    assert suite.get("name") == "alice: ch09"  # the student, by default the folder's name
    properties = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert properties["student"] == "alice" and properties["time_limit_s"] == "5"
    assert datetime.fromisoformat(suite.get("timestamp")) == \
        datetime.fromisoformat(properties["timestamp"])


def test_a_bare_exercises_folder_is_a_root_and_the_installed_course_fills_in(tmp_path, capsys):
    bob = _submission(tmp_path / "bob", {"ch10_balancing_loss": "solution"})
    assert run_checks("ch10.balancing_loss", root=bob).passed
    assert run_checks("ch10.balancing_loss", source="solutions", root=bob).passed  # installed
    assert grade_main(["--root", str(bob), "--only", "ch10.balancing_loss",
                       "--student", "Bob B."]) == 0
    out = capsys.readouterr().out
    assert "ch10 moe" in out  # the title from the installed notebooks
    assert "Bob B.: 2/2 checks passed" in out
    with pytest.raises(SystemExit):
        grade_main(["--root", str(tmp_path / "nobody")])
    assert "root must be a course folder holding exercises/" in capsys.readouterr().err


def test_a_check_whose_process_dies_fails_alone(tmp_path):
    dies = "import os\n\n\ndef zigzag_indices(seq_len, n, rank):\n    os._exit(3)\n"
    root = _submission(tmp_path / "carol", {"ch09_zigzag_indices": dies})
    report = run_isolated("ch09.zigzag_indices", root=root, timeout=20)
    assert [r.passed for r in report.results] == [False] * 3
    assert "the grading process died (exit code 3)" in report.results[0].message
    assert "not run" in report.results[1].message


def _grading(root: Path, *extra: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "engine.grading", "--root", str(root),
                             "--only", "ch09.online_softmax,ch09.zigzag_indices", *extra],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=default_sigint)


def _wait_for(path: Path, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the first exercise's junit never came"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGKILL])
def test_a_stopped_run_leaves_a_parseable_junit_and_no_process(tmp_path, stop):
    """The second exercise loops with a long limit; the run is stopped while it loops."""
    from engine.grading.processes import descendants

    root = _submission(tmp_path / "dave", {"ch09_online_softmax": "solution",
                                           "ch09_zigzag_indices": ZIGZAG_LOOP})
    xml = tmp_path / "dave.xml"
    env = {**os.environ, "DRILL_SCORES": str(tmp_path / "learner" / "drill.json")}
    proc = _grading(root, "--timeout", "300", "--junit", str(xml), env=env)
    started = []
    try:
        _wait_for(xml, proc)
        time.sleep(0.5)  # the looping exercise's process is started
        started = descendants(proc.pid)
        assert started
        proc.send_signal(stop)
        out, _ = proc.communicate(timeout=60)
    finally:  # a failure here must not leave the run behind for the next tests to find
        if proc.poll() is None:
            for pid in [proc.pid, *descendants(proc.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.communicate()
    cases = ET.parse(xml).getroot().findall("./testsuite/testcase")
    assert {c.get("classname") for c in cases} == {"ch09.online_softmax"}
    assert len(cases) == 3 and all(c.find("failure") is None for c in cases)
    if stop == signal.SIGINT:
        assert proc.returncode == 130
        assert f"stopped: dave graded on 1 of 2 exercises; {xml} holds those" in out
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in started)  # the endless loop did not outlive it


def test_two_roots_keep_their_own_hints_and_drill_scores(tmp_path, capsys):
    alice = _submission(tmp_path / "alice", {"ch10_balancing_loss": BY_T})
    bob = _submission(tmp_path / "bob", {"ch10_balancing_loss": BY_T})
    only = ["--only", "ch10.balancing_loss"]
    for _ in range(2):
        grade_main(["--root", str(alice), *only])
    assert "hint 2 (the API to use)" in capsys.readouterr().out  # alice's second attempt
    grade_main(["--root", str(bob), *only])
    out = capsys.readouterr().out
    assert "hint 1 (the idea)" in out and "hint 2 (" not in out  # bob's first: his own
    assert "(next: python -m engine.grading --only ch10.balancing_loss --hint 2" in out

    alice_file, bob_file = root_scores_path(alice), root_scores_path(bob)
    assert len({alice_file, bob_file, scores_path()}) == 3
    assert Attempts(attempts_path(alice_file)).entry("ch10.balancing_loss")["attempts"] == 2
    assert Attempts(attempts_path(bob_file)).entry("ch10.balancing_loss")["attempts"] == 1
    assert not attempts_path().exists()  # the learner's own file is untouched
    assert root_scores_path(ROOT) == scores_path()  # the course checkout is the learner's

    from engine.grading.drill import drills
    question = drills()["ch10.capacity"].question()
    scores = Scores(alice_file)
    scores.record(question, True)
    scores.save()
    grade_main(["--root", str(alice), *only])
    assert "moe 1/1 100%" in capsys.readouterr().out
    grade_main(["--root", str(bob), *only])
    assert "moe 0/0" in capsys.readouterr().out

    grade_main(["--root", str(alice), *only, "--fresh"])  # as if alice had never been graded
    out = capsys.readouterr().out
    assert "hint 1 (the idea)" in out and "hint 2 (" not in out and "moe 0/0" in out
    assert Attempts(attempts_path(alice_file)).entry("ch10.balancing_loss")["attempts"] == 3


def test_next_and_the_tables_follow_only_and_hint_asks_for_hints(tmp_path, capsys):
    erin = _submission(tmp_path / "erin", {"ch09_zigzag_indices": "solution",
                                           "ch09_online_softmax": "solution"})
    shutil.copy(ROOT / "exercises" / "ch09_ring_forward.py", erin / "exercises")  # the stub
    grade_main(["--root", str(erin), "--only", "ch09", "--hint", "3"])
    out = capsys.readouterr().out
    table = out[out.index("chapter            exercises"):]
    rows = [line.split()[0] for line in table.splitlines()[2:] if line[:2] == "ch"]
    assert rows == ["ch09"]  # only the chapter graded
    assert "next: write ch09.ring_forward in exercises/ch09_ring_forward.py" in out
    assert "ch00" not in out
    assert "hint 3 (the shape of the code)" in out  # --hint 3, even before the code runs
    score_table = out[out.index("chapter  exercise"):out.index("chapter            exercises")]
    assert "ch00" not in score_table and "ch09     chapter total" in score_table


def test_the_lab_guides_grading_commands_use_only_the_graders_flags():
    from engine.grading.__main__ import parser, release_parser

    text = (ROOT / "docs" / "lab.md").read_text()
    section = text.split("## 10. Grading a class", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"-m engine\.grading([^\n`]*)", re.sub(r"\\\n\s*", " ", section))
    commands += re.findall(r'ARGS="([^"]*)"', section)
    named = {flag for args in commands for flag in re.findall(r"(--[\w-]+)", args)}
    named |= set(re.findall(r"^\| `(--[\w-]+)", section, flags=re.M))  # the options table
    known = {option for cli in (parser(), release_parser()) for action in cli._actions
             for option in action.option_strings}
    assert len(commands) >= 4 and {"--root", "--timeout", "--fresh", "--hint"} <= named
    assert named <= known, named - known
