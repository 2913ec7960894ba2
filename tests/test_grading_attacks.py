"""A class that tries to cheat, graded as an instructor grades it (``python -m engine.grading
--class``, in a process of its own): every hostile submission in ``tests/attacks/`` ends as a
failed or refused exercise whose message names what happened, the honest students get their
true scores, the junit is the grader's own and parses, no process is left behind, and no file
outside the grader's own output changed.

Three modes: bubblewrap (the sandbox, where it works: ``make`` installs it as root), limits
alone (``--sandbox limits``: what holds without a sandbox), and the notebook's forked worker
for the process-group attack that made the old grader kill itself.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from engine.grading.sandbox import bwrap_works

# Grading a class of 19 in a sandbox takes about 100 s on 2 cores (each worker imports torch).
pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parent.parent
ATTACKS = Path(__file__).resolve().parent / "attacks"
ONLY = "ch01"
RING, VOLUME = "ch01_ring_all_reduce", "ch01_volume_formulas"


def _poses_as(attack: str) -> str:
    return (ATTACKS / f"{attack}.py").read_text().splitlines()[0].split(":")[0].lstrip("# ")


def _class(tmp: Path, attacks: list[str]) -> dict:
    """A class folder: alice (every ch01 solution), bob (the ring only) and one student per
    attack, whose other ch01 exercise is the untouched stub."""
    course = tmp / "class"
    marker_dir = tmp / "evidence"
    marker_dir.mkdir(parents=True)
    paths = {"junit": tmp / "out" / "class.xml", "scores": tmp / "out" / "scores.json",
             "class": course, "evidence": marker_dir}
    paths["junit"].parent.mkdir()
    paths["scores"].write_text('{"kept": true}')
    for student, files in [("alice", {RING: "solution", VOLUME: "solution"}),
                           ("bob", {RING: "solution"})] + [(a, {_poses_as(a): a})
                                                           for a in attacks]:
        folder = course / student / "exercises"
        folder.mkdir(parents=True)
        for module in (RING, VOLUME):
            what = files.get(module, "stub")
            if what == "solution":
                text = (ROOT / "solutions" / f"{module}.py").read_text()
            elif what == "stub":
                text = (ROOT / "exercises" / f"{module}.py").read_text()
            else:
                text = (ATTACKS / f"{what}.py").read_text()
                for key, value in {"__JUNIT__": paths["junit"], "__SCORES__": paths["scores"],
                                   "__OTHER__": course / "alice" / "exercises" / f"{VOLUME}.py",
                                   "__COURSE__": ROOT, "__MARKER__": marker_dir / what,
                                   "__TAG__": f"attack-tag-{tmp.name}"}.items():
                    text = text.replace(key, str(value))
            (folder / f"{module}.py").write_text(text)
    return paths


def _fingerprint(*folders: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for folder in folders for p in sorted(folder.rglob("*.py"))}


def _processes_with(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def _grade(paths: dict, *extra: str, timeout: float = 900) -> tuple[int, str]:
    proc = subprocess.Popen([sys.executable, "-m", "engine.grading", "--class",
                             str(paths["class"]), "--only", ONLY, "--junit",
                             str(paths["junit"]), *extra], cwd=paths["class"].parent,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"the grader did not finish in {timeout} s:\n{out.decode()[-3000:]}")
    return proc.returncode, out.decode("utf-8", "replace")


def _sections(out: str) -> dict[str, str]:
    """The grader's output, per student."""
    parts = re.split(r"^grading (\S+) \(", out, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _cases(junit: Path) -> dict[str, dict[str, str | None]]:
    """student -> {"exercise.check": failure message or None when passed}."""
    cases: dict[str, dict] = {}
    for suite in ET.parse(junit).getroot().iter("testsuite"):
        student = suite.get("name").split(": ")[0]
        for case in suite.iter("testcase"):
            failure = case.find("failure")
            cases.setdefault(student, {})[f"{case.get('classname')}.{case.get('name')}"] = \
                None if failure is None else failure.get("message")
    return cases


# attack -> (the exercise it poses as, what its failure must say)
EXPECTED = {
    "patch_comparisons": ("ch01.ring_all_reduce", r"was replaced"),
    "load_solutions": ("ch01.ring_all_reduce", r"No such file|refuses to open"),
    "patch_meter": ("ch01.ring_all_reduce", r"CommMeter\.bytes_sent was replaced"),
    "patch_in_function": ("ch01.ring_all_reduce", r"get_world_size was replaced"),
    "patch_grader": ("ch01.volume_formulas", r"was replaced"),
    "forged_files": ("ch01.volume_formulas", r"gives 1\.0 bytes"),
    "exit_at_import": ("ch01.volume_formulas", r"grading process died \(exit code 0\)"),
    "kill_parent": ("ch01.volume_formulas", r"gives 0\.0 bytes"),
    "daemon": ("ch01.volume_formulas", r"gives 0\.0 bytes"),
    "memory_hog": ("ch01.volume_formulas", r"allocate"),
    "loud": ("ch01.volume_formulas", r"ValueError"),
    "pickle_answer": ("ch01.volume_formulas", r"not accept|died|gives 0\.0 bytes"),
    "join_graders_group": ("ch01.volume_formulas", r"ps_worker_bytes gives"),
    "float_subclass": ("ch01.volume_formulas", r"gives -1\.0 bytes"),
    "tensor_subclass": ("ch01.ring_all_reduce", r"wrong sum"),
    "closure": ("ch01.ring_all_reduce", r"IndexError|EngineAnswerBlocked|switched off"),
    "many_processes": ("ch01.volume_formulas", r"refused after \d+ processes"),
}
# Without a sandbox the worker runs as the grader's user: one that kills the grader's PID (as
# the same user, or as root) cannot be stopped without the namespaces; everything else is
# stopped by the limits, the cgroup, the subreaper and the audit hooks (the README's grading
# section says what each mode stops).
WITHOUT_SANDBOX = [a for a in EXPECTED if a != "kill_parent"]


def _graded(tmp_path_factory, mode: str, attacks: list[str]) -> dict:
    tmp = tmp_path_factory.mktemp(f"class-{mode}")
    paths = _class(tmp, attacks)
    before = _fingerprint(ROOT / "solutions", ROOT / "engine" / "grading",
                          paths["class"] / "alice", paths["class"] / "bob")
    start = time.monotonic()
    code, out = _grade(paths, "--sandbox", mode, "--timeout", "20")
    written = paths["junit"].read_bytes()
    time.sleep(5)  # a daemon's rewrite would land by now
    return dict(paths=paths, code=code, out=out, before=before, seconds=time.monotonic() - start,
                junit_then=written, sections=_sections(out), attacks=attacks,
                tag=f"attack-tag-{tmp.name}")


@pytest.fixture(scope="module")
def sandboxed(tmp_path_factory):
    why_not = bwrap_works()
    if why_not:
        pytest.skip(f"no sandbox on this machine: {why_not}")
    return _graded(tmp_path_factory, "bwrap", list(EXPECTED))


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    return _graded(tmp_path_factory, "limits", WITHOUT_SANDBOX)


@pytest.fixture(params=["sandboxed", "limited"])
def graded(request):
    return request.getfixturevalue(request.param)


def test_every_student_is_graded_and_the_honest_ones_get_their_true_scores(graded):
    assert graded["code"] == 1, graded["out"][-3000:]
    cases = _cases(graded["paths"]["junit"])
    assert set(cases) == {"alice", "bob", *graded["attacks"]}, graded["out"][-3000:]
    assert all(message is None for message in cases["alice"].values()), cases["alice"]
    assert [k for k, v in cases["bob"].items() if v is None] == [
        "ch01.ring_all_reduce.sums_exactly", "ch01.ring_all_reduce.sends_2_n_minus_1_over_n"]
    table = graded["out"].rsplit("student", 1)[1]
    assert re.search(r"alice\s+5/5\s+2/2", table) and re.search(r"bob\s+2/5\s+1/2", table)


def test_the_junit_is_the_graders_parseable_and_never_rewritten(graded):
    junit = graded["paths"]["junit"]
    assert junit.read_bytes() == graded["junit_then"]  # nothing wrote it after the grader
    assert b'name="forged"' not in junit.read_bytes()  # the forged testcase
    ET.parse(junit)  # parses: control characters cleaned
    assert "\x1b" not in graded["out"]  # no escape sequence reached the terminal
    assert len(graded["out"]) < 400_000  # 7 MB printed, capped per exercise
    assert graded["paths"]["scores"].read_text() == '{"kept": true}'


def test_no_file_changed_and_no_process_left(graded):
    paths = graded["paths"]
    after = _fingerprint(ROOT / "solutions", ROOT / "engine" / "grading",
                         paths["class"] / "alice", paths["class"] / "bob")
    assert after == graded["before"]
    assert not list(paths["evidence"].iterdir())  # no marker: no daemon, no unpickled code
    assert _processes_with(graded["tag"]) == []
    assert _processes_with("sleep\x00600") == []


@pytest.mark.parametrize("mode, attack", [("sandboxed", a) for a in EXPECTED]
                         + [("limited", a) for a in WITHOUT_SANDBOX])
def test_each_attack_fails_with_a_message_naming_what_happened(request, mode, attack):
    graded = request.getfixturevalue(mode)
    exercise, says = EXPECTED[attack]
    cases = _cases(graded["paths"]["junit"])[attack]
    mine = {k: v for k, v in cases.items() if k.startswith(exercise + ".")}
    assert mine and any(v is not None for v in mine.values()), graded["sections"][attack]
    assert any(v is not None and re.search(says, v) for v in mine.values()), (
        mine, graded["sections"][attack])


def test_the_report_says_which_protections_were_on(graded):
    first = graded["sections"]["alice"].splitlines()[1]
    mode = "bubblewrap" if graded["attacks"] == list(EXPECTED) else "OFF"
    assert first.startswith("sandbox:") and mode in first


def test_a_grandchild_in_the_graders_own_group_does_not_kill_the_grader(tmp_path):
    """The old grader killed the process group of every process the worker started: one that
    joined the grader's own group made it kill itself (a forked worker: no sandbox)."""
    paths = _class(tmp_path, ["join_graders_group", "daemon"])
    code, out = _grade(paths, "--sandbox", "none", "--timeout", "20")
    assert code == 1 and "student" in out.rsplit("\n\n", 1)[-1], out[-2000:]
    cases = _cases(paths["junit"])
    assert set(cases) == {"alice", "bob", "join_graders_group", "daemon"}
    time.sleep(5)
    assert not list(paths["evidence"].iterdir())
    assert _processes_with(f"attack-tag-{tmp_path.name}") == []
