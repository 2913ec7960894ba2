"""Several nodes, on loopback: two torchrun agents with a c10d rendezvous on 127.0.0.1, two
processes each, train exactly what one launch of four ranks trains; when one agent is killed
the other exits non-zero within the process-group timeout, naming the ranks it lost; a
rendezvous that never completes fails within its own timeout. No process is left behind."""

from __future__ import annotations

import re
import time
from pathlib import Path

from engine.__main__ import main as engine_main
from tests.helpers import descendants, is_running
from tests.test_resume import assert_same_checkpoint
from tests.torchrun_agents import agent_pids, free_port, start_agent, stop

TRAIN = ["--dp", "2", "--tp", "2"]
GUARD_S = 120  # against a hang only; each agent runs ~15-25 s on 2 idle cores


def two_node_args(port: int, run_id: str, *more: str) -> list[str]:
    return ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, "--max-restarts", "0",
            *more]


def wait_all(agents, seconds: float, seen: set[int]) -> None:
    deadline = time.monotonic() + seconds
    while any(a.poll() is None for a in agents) and time.monotonic() < deadline:
        for agent in agents:
            seen.update(agent_pids(agent))
        time.sleep(0.2)


def test_two_agents_on_loopback_train_what_one_launch_of_four_ranks_trains(tmp_path, capsys):
    assert engine_main(["train", "--world-size", "4", *TRAIN, "--save",
                        str(tmp_path / "one")]) == 0
    capsys.readouterr()
    port, logs, seen = free_port(), [tmp_path / "node0.log", tmp_path / "node1.log"], set()
    agents = []
    try:
        for log in logs:  # the first agent to start hosts the rendezvous store
            agents.append(start_agent(two_node_args(port, "loopback"),
                                      [*TRAIN, "--save", str(tmp_path / "two")], log))
        wait_all(agents, GUARD_S, seen)
        codes = [a.poll() for a in agents]
    finally:
        for agent in agents:
            stop(agent)
    outs = [log.read_text(errors="replace") for log in logs]
    assert codes == [0, 0], [out[-2000:] for out in outs]
    assert sorted(out.count("tokens/s") for out in outs) == [0, 1]  # one report, by rank 0
    assert_same_checkpoint(tmp_path / "one" / "step-00000004",
                           tmp_path / "two" / "step-00000004")
    assert [pid for pid in seen if is_running(pid)] == [] and descendants() == []


def test_a_killed_agent_makes_the_other_exit_naming_the_lost_ranks(tmp_path):
    port, logs, seen = free_port(), [tmp_path / "node0.log", tmp_path / "node1.log"], set()
    timeout_s = 20  # the process group's: no collective waits longer for a lost peer
    agents = []
    try:
        for log in logs:
            agents.append(start_agent(two_node_args(port, "kill"),
                                      [*TRAIN, "--steps", "100000", "--timeout",
                                       str(timeout_s)], log))
            time.sleep(1)  # so that the first one hosts the store
        deadline = time.monotonic() + GUARD_S
        while not any("step 3/" in log.read_text(errors="replace") for log in logs):
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents)
            time.sleep(0.2)
        survivor, victim = agents
        lost = [pid for pid in agent_pids(victim) if pid != victim.pid]  # its two workers
        seen.update(agent_pids(survivor) + agent_pids(victim))
        assert len(lost) == 2
        victim.kill()  # SIGKILL to the agent alone: its workers must die with it
        killed_at = time.monotonic()
        wait_all([survivor], timeout_s + 10, seen)
        took = time.monotonic() - killed_at
        code = survivor.poll()
    finally:
        for agent in agents:
            stop(agent)
    out = logs[0].read_text(errors="replace")
    assert code not in (None, 0), out[-2000:]
    assert took < timeout_s + 10, took  # the timeout is a bound, not a hang
    named = re.search(r"PeerLostError: lost peers: rank (\d) \(pid (\d+) on [^)]+\), rank (\d) "
                      r"\(pid (\d+) on [^)]+\) are gone", out)
    assert named, out[-3000:]
    assert sorted(map(int, named.group(2, 4))) == sorted(lost)
    assert [pid for pid in seen if is_running(pid)] == [] and descendants() == []


def test_a_rendezvous_that_never_completes_fails_within_its_timeout(tmp_path):
    log = tmp_path / "alone.log"
    agent = start_agent(two_node_args(free_port(), "alone", "--rdzv-conf", "join_timeout=5"),
                        TRAIN, log)
    started = time.monotonic()
    try:
        agent.wait(timeout=GUARD_S)
    finally:
        stop(agent)
    out = Path(log).read_text(errors="replace")
    assert agent.returncode != 0
    assert "RendezvousTimeoutError" in out
    assert "training on" not in out  # no worker ever started
    assert time.monotonic() - started < 5 + 30  # join_timeout, plus starting Python
    assert descendants() == []

