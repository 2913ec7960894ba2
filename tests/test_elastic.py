"""Elastic restarts: under ``torchrun --max-restarts 2`` (one node, 4 processes on the CPU), a
rank SIGKILLed mid-training makes torchrun restart the workers; they resume from the last
checkpoint and end bit-identical to the uninterrupted run. No process is left behind."""

from __future__ import annotations

import re
import time

import pytest

from engine.__main__ import main as engine_main
from engine.checkpoint.trainer import step_dir
from engine.launch.elastic import check_restartable
from tests.helpers import descendants, is_running
from tests.test_resume import assert_same_checkpoint
from tests.torchrun_agents import agent_pids, start_agent, stop

TRAIN = ["--dp", "2", "--tp", "2", "--steps", "7"]  # 7 steps in all
AGENT_TIMEOUT_S = 120  # a guard against a hang; the run takes ~20 s on 2 idle cores


def test_a_killed_rank_is_restarted_and_resumes_to_the_uninterrupted_result(tmp_path, capsys):
    assert engine_main(["train", "--world-size", "4", *TRAIN, "--save",
                        str(tmp_path / "whole")]) == 0
    capsys.readouterr()
    saved, log = tmp_path / "elastic", tmp_path / "agent.log"
    agent = start_agent(["--standalone", "--nproc-per-node", "4", "--max-restarts", "2"],
                        [*TRAIN, "--save", str(saved), "--save-every", "2", "--resume",
                         "--kill-at-step", "3", "--kill-rank", "1"], log,
                        env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + AGENT_TIMEOUT_S
        while agent.poll() is None and time.monotonic() < deadline:
            seen.update(agent_pids(agent))  # the workers of both attempts
            time.sleep(0.2)
        code = agent.poll()
    finally:
        stop(agent)
    out = log.read_text(errors="replace")
    assert code == 0, out[-3000:]
    assert "rank 1: killed by --kill-at-step 3" in out
    assert re.search(r"failed \(exitcode: -9\) local_rank: 1", out)  # torchrun saw the kill
    assert f"resumed from {step_dir(saved, 2)} after step 2" in out  # the restart resumed
    assert out.count("training on 4 rank(s)") == 2  # one restart was enough
    assert_same_checkpoint(tmp_path / "whole" / "step-00000007", saved / "step-00000007")
    assert len(seen) >= 1 + 4 + 4
    assert [pid for pid in seen if is_running(pid)] == [] and descendants() == []


def test_restarts_with_a_shared_rendezvous_store_are_refused_up_front(monkeypatch):
    """Measured: restarted workers that share torchrun's rendezvous store read the previous
    attempt's addresses and cannot connect; the first attempt says so and how to avoid it."""
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(ValueError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        check_restartable()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    check_restartable()
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    check_restartable()
