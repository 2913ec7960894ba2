"""engine train --save DIR --async-save (engine.checkpoint.trainer.AsyncSaver): the step waits only for
a host snapshot, a background thread writes it by the same protocol. The checkpoints it writes
equal the synchronous save's bit for bit, a run resumed from one ends equal to a run resumed
from the other, and a rank killed during a background write leaves the previous checkpoint the
newest complete one."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from engine import LaunchError
from engine.__main__ import main as engine_main
from engine.checkpoint import protocol
from engine.checkpoint.snapshot import host_copy
from engine.checkpoint.trainer import complete, step_dir
from tests.helpers import descendants
from tests.test_resume import assert_same_checkpoint

ZERO2 = ["--dp", "2", "--zero", "2"]


def train(*args: str) -> int:
    return engine_main(["train", *ZERO2, *args])


def test_async_checkpoints_equal_sync_ones_and_resume_alike(tmp_path, capsys):
    sync, later = tmp_path / "sync", tmp_path / "async"
    assert train("--steps", "4", "--save-every", "2", "--save", str(sync)) == 0
    assert train("--steps", "4", "--save-every", "2", "--save", str(later), "--async-save") == 0
    out = capsys.readouterr().out
    assert "(checkpoint snapshot taken, step blocked" in out  # the async run said so
    for step in (2, 4):  # what the background thread wrote is what the step would have
        assert_same_checkpoint(step_dir(sync, step), step_dir(later, step))
    # each resumed from its own step 4, on to step 6 (the async run saving asynchronously)
    assert train("--steps", "6", "--save", str(sync), "--resume") == 0
    assert train("--steps", "6", "--save", str(later), "--resume", "--async-save") == 0
    assert "resumed from" in capsys.readouterr().out
    assert_same_checkpoint(step_dir(sync, 6), step_dir(later, 6))
    assert [p.name for p in complete(later)] == ["step-00000004", "step-00000006"]
    assert not list(later.glob(".step-*"))  # no temporary directory left behind
    assert descendants() == []


def _killed_while_writing(step: int, rank: int):
    """``write_atomically`` that SIGKILLs global rank ``rank`` in the background thread right
    after it wrote its file of checkpoint ``step``: a crash in the middle of an async save."""
    original = protocol.write_atomically

    def write(path, data):
        original(path, data)
        if f".step-{step:08d}.tmp" in str(path) and \
                threading.current_thread() is not threading.main_thread() and \
                torch.distributed.get_rank() == rank:
            os.kill(os.getpid(), signal.SIGKILL)
    return write


def test_a_crash_during_the_background_write_keeps_the_previous_checkpoint(
        tmp_path, capsys, monkeypatch):
    root = tmp_path / "run"
    monkeypatch.setattr(protocol, "write_atomically", _killed_while_writing(4, 1))
    with pytest.raises(LaunchError, match=r"rank 1 was killed by signal SIGKILL"):
        train("--steps", "6", "--save-every", "2", "--save", str(root), "--async-save")
    monkeypatch.undo()
    assert [p.name for p in complete(root)] == ["step-00000002"]  # step 4 never completed
    assert any(Path(root, ".step-00000004.tmp").glob("*.pt"))  # though a shard was written
    capsys.readouterr()
    assert train("--steps", "4", "--save-every", "2", "--save", str(root), "--resume",
                 "--async-save") == 0
    assert f"resumed from {step_dir(root, 2)} after step 2" in capsys.readouterr().out
    whole = tmp_path / "whole"
    assert train("--steps", "4", "--save", str(whole)) == 0
    assert_same_checkpoint(step_dir(whole, 4), step_dir(root, 4))
    assert descendants() == []


def test_a_host_snapshot_is_a_copy_the_training_cannot_change():
    weight = torch.ones(3)
    state = {"param": weight, "optimizer": {"state": {0: {"exp_avg": weight * 2}}},
             "step": [torch.tensor(1.0)], "name": "x"}
    taken = host_copy(state)
    weight.add_(1)
    state["optimizer"]["state"][0]["exp_avg"].zero_()
    assert torch.equal(taken["param"], torch.ones(3))
    assert torch.equal(taken["optimizer"]["state"][0]["exp_avg"], torch.full((3,), 2.0))
    assert taken["name"] == "x" and isinstance(taken["step"], list)


@pytest.mark.parametrize("args, message", [
    (["--async-save"], "--async-save needs --save DIR")])
def test_async_save_needs_a_directory(args, message, capsys):
    assert engine_main(["train", *ZERO2, *args]) == 2
    assert message in capsys.readouterr().err
