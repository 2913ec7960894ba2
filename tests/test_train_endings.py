"""How ``python -m engine train`` ends when it does not reach its last step: Ctrl-C prints one
line (the step, the newest complete checkpoint, the command that resumes) and exits 130; a
surviving rank of a lost peer prints the one PeerLostError line, its traceback in the log file
the line names; a run with nothing to do and a save directory in use say so. No process is
left behind."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from engine.__main__ import main as engine_main
from engine.train.endings import resume_command
from tests.helpers import descendants, is_running
from tests.torchrun_agents import REPO, agent_pids, free_port, start_agent, stop

GUARD_S = 120  # against a hang only


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a shell's background job ignores it


def _wait_for(stream, pattern: str, seconds: float) -> list[str]:
    """Lines of ``stream`` up to the first that matches ``pattern``."""
    lines, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        lines.append(line)
        if re.search(pattern, line):
            return lines
    raise AssertionError(f"no line matching {pattern!r} in {''.join(lines)[-2000:]}")


def test_ctrl_c_prints_one_line_with_the_step_the_checkpoint_and_how_to_resume(tmp_path):
    save = tmp_path / "run"
    argv = ["--world-size", "2", "--dp", "2", "--steps", "100000", "--save", str(save),
            "--save-every", "2"]
    train = subprocess.Popen([sys.executable, "-m", "engine", "train", *argv], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=_default_sigint)
    try:
        # the ranks' progress reaches a pipe as it goes, one line per step
        before = _wait_for(train.stdout, r"^step 2/100000 .*\(checkpoint saved\)", GUARD_S)
        assert "(warm-up, not timed)" in next(x for x in before if x.startswith("step 1/"))
        train.send_signal(signal.SIGINT)
        out, err = train.communicate(timeout=GUARD_S)
    finally:
        train.kill()
        train.wait()
    assert train.returncode == 130, err
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    said = re.fullmatch(r"stopped by Ctrl-C after step (\d+) of 100000; the newest complete "
                        r"checkpoint: (\S+); resume with: (.*)", lines[0])
    assert said, lines[0]
    step, newest = int(said.group(1)), Path(said.group(2))
    assert step >= 2 and newest.parent == save and newest.is_dir()
    assert int(newest.name.removeprefix("step-")) in (step, step - 1)  # every 2 steps
    assert said.group(3) == "python -m engine train " + " ".join(argv) + " --resume"
    assert descendants() == []


def test_the_resume_command_drops_the_labs_kill_and_keeps_everything_else():
    assert resume_command(["--dp", "2", "--kill-at-step", "3", "--kill-rank=1", "--save",
                           "/a b"], under_torchrun=False) == \
        "python -m engine train --dp 2 --save '/a b' --resume"
    assert resume_command(["--save", "d", "--resume"], under_torchrun=True) == \
        "the same torchrun command, with: -m engine train --save d --resume"


def test_ctrl_c_without_save_says_nothing_can_be_resumed():
    from engine.train.cli import parse
    from engine.train.endings import interrupted

    cfg, _, _ = parse(["--steps", "10"])
    assert interrupted(cfg, ["--steps", "10"], 3) == (
        "stopped by Ctrl-C after step 3 of 10; no checkpoint (this run had no --save DIR), "
        "so a new run starts at step 1")


def _rank_of(pid: int) -> int | None:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    rank = [v.split(b"=", 1)[1] for v in environ if v.startswith(b"RANK=")]
    return int(rank[0]) if rank else None


def test_a_surviving_rank_prints_one_line_and_logs_the_traceback(tmp_path):
    """Two torchrun agents on loopback, one rank each (two nodes, as torchrun sees them): the
    second agent is killed, its worker dies with it, and the first agent's worker is the
    survivor. (Under one agent, the agent itself stops the survivor when it sees the other
    die, often before the survivor's collective fails.)"""
    port, logs = free_port(), [tmp_path / "node0.log", tmp_path / "node1.log"]
    agents, seen = [], set()
    try:
        for log in logs:  # the first agent to start hosts the rendezvous store
            agents.append(start_agent(
                ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "lost",
                 "--max-restarts", "0"],
                ["--dp", "2", "--steps", "100000", "--timeout", "20"], log))
            time.sleep(1)
        deadline = time.monotonic() + GUARD_S
        while not any("step 3/" in log.read_text(errors="replace") for log in logs):
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents)
            time.sleep(0.2)
        survivor, victim = agents
        seen.update(agent_pids(survivor) + agent_pids(victim))
        lost = {_rank_of(pid): pid for pid in agent_pids(victim) if pid != victim.pid}
        assert len(lost) == 1, lost
        (rank, pid), = lost.items()
        victim.kill()  # SIGKILL to the agent: its worker dies with it
        survivor.wait(timeout=GUARD_S)
    finally:
        for agent in agents:
            stop(agent)
    out = logs[0].read_text(errors="replace")
    assert survivor.returncode not in (None, 0), out[-3000:]
    worker_lines = [line for line in out.splitlines() if line.startswith(f"rank {1 - rank}: ")]
    assert len(worker_lines) == 1, out[-3000:]
    said = re.fullmatch(rf"rank {1 - rank}: PeerLostError: lost peer: rank {rank} \(pid "
                        r"(\d+) on [^)]+\) is gone\. .* \(full traceback: (\S+)\)",
                        worker_lines[0])
    assert said, worker_lines[0]
    assert int(said.group(1)) == pid
    traceback_log = Path(said.group(2))
    assert traceback_log.exists() and "Traceback" in traceback_log.read_text()
    traceback_log.unlink()
    assert not re.search(r"^\[rank\d+\]:", out, re.M), out[-3000:]  # no traceback dumped
    # torchrun's failure summary shows the same line, not a link to its docs
    assert "traceback : " + worker_lines[0] in out
    assert [p for p in seen if is_running(p)] == [] and descendants() == []


def test_a_refused_start_and_a_finished_run_say_so(tmp_path, capsys):
    save = str(tmp_path / "run")
    assert engine_main(["train", "--world-size", "1", "--steps", "2", "--save", save]) == 0
    capsys.readouterr()
    assert engine_main(["train", "--world-size", "1", "--steps", "2", "--save", save]) == 2
    assert "already holds checkpoints (the newest: step-00000002); pass --resume" in \
        capsys.readouterr().err
    assert engine_main(["train", "--world-size", "1", "--steps", "2", "--save", save,
                        "--resume"]) == 0
    assert "holds all 2 steps of this run: nothing to do (raise --steps to train on from it" \
        in capsys.readouterr().out


def test_steps_k_trains_k_steps_and_names_the_checkpoint_after_the_last(tmp_path, capsys):
    """--steps 3: steps 1/3 (the warm-up, not timed) to 3/3, and step-00000003."""
    assert engine_main(["train", "--world-size", "1", "--steps", "3", "--save",
                        str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.findall(r"\[rank 0\] step (\d)/(\d)", out) == [("1", "3"), ("2", "3"),
                                                             ("3", "3")]
    assert "step 1/3 [" in out and "(warm-up, not timed)" in out
    assert "over 2 timed step(s)" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003"]
