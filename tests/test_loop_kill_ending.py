"""How a local ``python -m engine train --kill-at-step K`` ends: the lab's deliberate kill
prints what happened (which rank, after which step), what an elastic run would do instead and
the command that resumes, with exit code 137 and no traceback; a rank that dies any other way
still raises its ``RankDiedError`` with the traceback."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import engine.train.cli
from engine.__main__ import command_line
from engine.launch import RankDiedError
from engine.train.endings import KILLED_EXIT
from tests.helpers import descendants
from tests.torchrun_agents import REPO

GUARD_S = 60  # against a hang only; the run takes about 5 s


def test_the_labs_kill_ends_with_what_happened_and_what_to_do(tmp_path):
    save = tmp_path / "run"
    argv = ["--world-size", "2", "--dp", "2", "--steps", "4", "--save", str(save),
            "--save-every", "2", "--kill-at-step", "2"]
    done = subprocess.run([sys.executable, "-m", "engine", "train", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=GUARD_S)
    assert done.returncode == KILLED_EXIT == 137, done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
    assert "RankDiedError" not in done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 3, done.stderr
    assert lines[0] == ("rank 1 was killed on purpose by --kill-at-step 2 (a lab option), "
                        "after step 2 of 4; a local run has no agent to restart it, so the "
                        "run stopped (exit code 137).")
    assert "--max-restarts" in lines[1] and \
        f"continue from the newest complete checkpoint, {save / 'step-00000002'}; with " \
        "per-step fault tolerance (chapter 11, engine.ft) the other replica groups would go " \
        "on and the killed one rejoin from a live peer." in lines[1], lines[1]
    assert lines[2] == ("resume here with: python -m engine train --world-size 2 --dp 2 "
                        f"--steps 4 --save {save} --save-every 2 --resume")
    assert sorted(p.name for p in save.iterdir()) == ["step-00000002"]
    assert descendants() == []


def _dies(error):
    def main(argv):
        raise error
    return main


KILL_LINE = {1: "rank 1: killed by --kill-at-step 2 (a lab/test option)\n"}


@pytest.mark.parametrize("error", [
    RankDiedError("rank 0 was killed by signal SIGKILL", [0], {0: ""}),  # not --kill-rank
    RankDiedError("rank 1 was killed by signal SIGSEGV", [1], KILL_LINE),  # not SIGKILL
    RankDiedError("rank 1 was killed by signal SIGKILL", [1], {1: ""}),  # the OOM killer
    RankDiedError("rank 1 exited with code 3 without returning a result", [1], KILL_LINE),
], ids=["another-rank", "another-signal", "no-kill-line", "an-exit"])
def test_an_unexpected_death_keeps_its_traceback(error, monkeypatch, capsys):
    monkeypatch.setattr(engine.train.cli, "main", _dies(error))
    with pytest.raises(RankDiedError) as raised:
        command_line(["train", "--world-size", "2", "--dp", "2", "--kill-at-step", "2"])
    assert raised.value is error and capsys.readouterr().err == ""


def test_without_kill_at_step_a_death_keeps_its_traceback(monkeypatch):
    error = RankDiedError("rank 1 was killed by signal SIGKILL", [1], KILL_LINE)
    monkeypatch.setattr(engine.train.cli, "main", _dies(error))
    with pytest.raises(RankDiedError):
        command_line(["train", "--world-size", "2", "--dp", "2"])


def test_the_kill_without_save_says_nothing_can_be_resumed(monkeypatch, capsys):
    error = RankDiedError("rank 1 was killed by signal SIGKILL", [1], KILL_LINE)
    monkeypatch.setattr(engine.train.cli, "main", _dies(error))
    assert command_line(["train", "--world-size", "2", "--dp", "2", "--steps", "5",
                         "--kill-at-step", "2"]) == KILLED_EXIT
    err = capsys.readouterr().err
    assert re.search(r"would restart every rank and start over at step 1 \(this run had no "
                     r"--save DIR, so no checkpoint\); with per-step .*\.\nnothing to resume",
                     err), err
