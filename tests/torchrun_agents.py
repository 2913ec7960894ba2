"""Start torchrun agents as a lab would, for the elastic and multi-node tests: each agent in
its own session, its output in a file; stop one with everything it started."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tests.helpers import descendants, is_running

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_agent(torchrun_args: list[str], train_args: list[str], log: Path,
                env: dict[str, str] | None = None) -> subprocess.Popen:
    """``torchrun TORCHRUN_ARGS -m engine train TRAIN_ARGS``, output to ``log``."""
    command = [sys.executable, "-m", "torch.distributed.run", *torchrun_args,
               "-m", "engine", "train", *train_args]
    with open(log, "wb") as out:
        return subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def stop(agent: subprocess.Popen) -> None:
    """Kill the agent and every process below it (torchrun starts each worker in a session
    of its own), then reap the agent."""
    for pid in [agent.pid, *descendants(agent.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait()


def agent_pids(agent: subprocess.Popen) -> list[int]:
    """The agent and its live workers."""
    return [pid for pid in [agent.pid, *descendants(agent.pid)] if is_running(pid)]
