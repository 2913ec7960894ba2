"""scripts/gpu_check.sh, checked on a CPU: offline, every command under a timeout, a summary
whatever happens; and the smoke checks of scripts/gpu_smoke.py that a CPU can run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
SMOKE = ROOT / "scripts" / "gpu_smoke.py"

# What reaches for the network, or rebuilds the environment the check is meant to test.
NETWORK = ("make", "pip", "pip3", "uv", "conda", "mamba", "curl", "wget", "git", "apt",
           "apt-get")


def _commands() -> list[str]:
    """The script's logical lines (continuations joined, comments dropped)."""
    text = re.sub(r"\\\n\s*", " ", SCRIPT.read_text())
    lines = [line.split(" #")[0].strip() for line in text.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_the_script_never_sets_up_or_reaches_the_network():
    for line in _commands():
        code = re.sub(r"'[^']*'|\"[^\"]*\"", " ", line)  # what is said in strings is not run
        for word in re.split(r"[\s;|&()$`]+", code):
            assert word not in NETWORK, f"gpu_check.sh calls {word!r}: {line}"
        assert "-m pip" not in line and "http" not in line, line


def test_every_command_line_runs_under_timeout():
    """A line that runs Python, pytest, torchrun or nvidia-smi starts the program under
    `timeout`, or is a `run_step`, which runs its command under `timeout`."""
    body = SCRIPT.read_text()
    start = body.index("run_step() {")
    assert re.search(r'^\s*timeout --foreground -s INT -k \d+ "\$limit" "\$@"',
                     body[start:body.index("\n}\n", start)], re.M)
    invokes = re.compile(r'"\$(PY|candidate)" (?!\])|\bnvidia-smi\b|^(python3?|pytest|torchrun)\b')
    runs = [line for line in _commands() if invokes.search(line)]
    assert len(runs) >= 10  # the probes, six smoke steps, pytest
    for line in runs:
        assert line.startswith("run_step ") or re.search(r"\btimeout\b", line), line


def test_pytest_runs_without_the_projects_plugin_options():
    pytest_line = next(line for line in _commands() if "-m pytest" in line)
    assert '-o addopts=""' in pytest_line and "-m gpu" in pytest_line


# Stands in for Python: answers the script's probes (torch imports; one GPU) at once and hangs
# in every step, so each step can only time out.
_HANGING_PYTHON = """#!/usr/bin/env bash
case "$*" in
    *device_count*) echo 1 ;;
    -c*) ;;
    *) exec sleep 600 ;;
esac
"""

STEP_NAMES = ["environment", "NCCL at world size 1: engine.launch",
              "NCCL at world size 1: engine train --impl both",
              "Gloo with CUDA tensors, 3 ranks on one GPU", "forked Gloo ranks touching CUDA",
              "a CPU lesson on a GPU host stays on Gloo",
              "torchrun --nproc-per-node 2 on this machine", "tests marked gpu"]


def _summary(stdout: str) -> list[tuple[str, str]]:
    lines = stdout.split("== summary", 1)[1].splitlines()[1:]
    return [tuple(line.strip().split(" | ")[:2]) for line in lines if " | " in line]


@pytest.mark.timeout(120)
def test_a_step_that_times_out_still_ends_in_a_summary(tmp_path):
    """A 20 s budget and a Python that hangs: the first step is stopped by `timeout` when the
    budget runs out, the others are skipped, and the summary lists every step."""
    python = tmp_path / "python"
    python.write_text(_HANGING_PYTHON)
    python.chmod(0o755)
    env = dict(os.environ, GPU_CHECK_PYTHON=str(python), GPU_CHECK_BUDGET_S="20")
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env,
                          timeout=100)
    summary = _summary(done.stdout)
    assert [name for _, name in summary] == STEP_NAMES, done.stdout
    statuses = [status for status, _ in summary]
    assert statuses[0] == "PASS"
    assert re.fullmatch(r"TIMEOUT after \d+ s", statuses[1]), statuses
    assert statuses[2:] == ["SKIPPED"] * 6
    assert done.returncode == 1


@pytest.mark.timeout(120)
def test_an_interrupted_check_still_ends_in_a_summary(tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group) part way through a step."""
    python = tmp_path / "python"
    python.write_text(_HANGING_PYTHON)
    python.chmod(0o755)
    env = dict(os.environ, GPU_CHECK_PYTHON=str(python), GPU_CHECK_BUDGET_S="290")
    proc = subprocess.Popen(["bash", str(SCRIPT)], stdout=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _sleeping_under(proc.pid):
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    summary = _summary(out)
    assert summary[0] == ("PASS", "environment")
    assert summary[-1] == ("INTERRUPTED", STEP_NAMES[1]), out
    assert proc.returncode == 130


def _sleeping_under(pid: int) -> bool:
    """True once the script's first step (the hanging stand-in) is running."""
    from tests.helpers import descendants

    return any(Path(f"/proc/{p}/comm").read_text().strip() == "sleep" for p in descendants(pid)
               if Path(f"/proc/{p}/comm").exists())


def _smoke(*argv, timeout=120):
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_smoke_cpu_lesson_runs_on_gloo():
    done = _smoke(str(SMOKE), "cpu-lesson")
    assert done.returncode == 0, done.stderr
    assert "RESULT: a notebook-style launch with 0 GPU(s) visible ran on Gloo" in done.stdout


@pytest.mark.timeout(180)
def test_smoke_torchrun_on_a_machine_with_too_few_gpus():
    done = _smoke("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                  str(SMOKE), "torchrun", timeout=150)
    assert done.returncode == 0, done.stdout + done.stderr
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT: ")]
    assert len(results) == 1  # printed by global rank 0 only
    assert "default -> Gloo on every rank; NCCL refused on every rank" in results[0]
