"""engine train --save/--resume: a run killed mid-training and resumed from its last checkpoint
ends bit-identical to the uninterrupted run (loss curve, parameters, optimizer state) for
every layout of the composed engine, each rank saving its own state
(engine.checkpoint.per_rank); checkpoints are atomic, pruned, and bad input is refused
clearly."""

from __future__ import annotations

import json
import re

import pytest
import torch

from engine import LaunchError
from engine.__main__ import main as engine_main
from engine.checkpoint.files import MANIFEST
from engine.checkpoint.per_rank import read_rank_state
from engine.checkpoint.trainer import complete, step_dir
from tests.helpers import descendants

LAYOUTS = {
    "DDP": ["--dp", "2", "--zero", "0"],
    # the compressor's error-feedback residuals are part of each rank's state
    "DDP Top-K": ["--dp", "2", "--zero", "0", "--compress", "topk:0.1"],
    "ZeRO-1": ["--dp", "2", "--zero", "1"],
    "ZeRO-2": ["--dp", "2", "--zero", "2"],
    "ZeRO-3": ["--dp", "3", "--zero", "3"],  # three ranks: every unit padded
    "TP": ["--tp", "2"],
    "PP": ["--pp", "2"],
    "3D": ["--dp", "2", "--tp", "2", "--pp", "2"],
}
STEPS = ["--steps", "5"]  # 5 optimizer steps: a warm-up step and 4 timed ones


def train(*args: str) -> int:
    return engine_main(["train", *STEPS, *args])


def assert_same_state(x, y, where=()) -> int:
    """``x`` and ``y`` (nested dicts, lists, tensors, numbers) equal, tensors bit for bit;
    the number of tensors compared."""
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and torch.equal(x, y), where
        return 1
    if isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys(), where
        return sum(assert_same_state(x[k], y[k], (*where, k)) for k in x)
    if isinstance(x, (list, tuple)):
        assert isinstance(y, (list, tuple)) and len(x) == len(y), where
        return sum(assert_same_state(a, b, (*where, i)) for i, (a, b) in enumerate(zip(x, y)))
    assert x == y, where
    return 0


def assert_same_checkpoint(a, b) -> None:
    """Every rank's parameters, optimizer state (and compressor memory), and the loss curve:
    bit for bit."""
    assert json.loads((a / "trainer.json").read_text()) == \
        json.loads((b / "trainer.json").read_text())
    ranks = json.loads((a / MANIFEST).read_text())["world_size"]
    assert ranks == json.loads((b / MANIFEST).read_text())["world_size"]
    for rank in range(ranks):
        assert assert_same_state(read_rank_state(a, rank), read_rank_state(b, rank),
                                 (rank,)) > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_killed_and_resumed_equals_uninterrupted(layout, tmp_path, capsys):
    args = LAYOUTS[layout]
    assert train(*args, "--save", str(tmp_path / "whole")) == 0
    capsys.readouterr()
    killed = tmp_path / "killed"
    with pytest.raises(LaunchError, match=r"rank \d was killed by signal SIGKILL"):
        train(*args, "--save", str(killed), "--save-every", "2", "--kill-at-step", "3")
    assert [p.name for p in complete(killed)] == ["step-00000002"]  # step 3 was never saved
    capsys.readouterr()
    assert train(*args, "--save", str(killed), "--save-every", "2", "--resume") == 0
    out = capsys.readouterr().out
    assert f"resumed from {step_dir(killed, 2)} after step 2" in out
    losses = re.search(r"loss per step[^:]*: (.*)", out).group(1)
    assert len(re.findall(r"\d\.\d{7}", losses)) == 5  # the whole curve, steps 1-2 saved
    assert re.search(r"^(\d\.\d{7}, ){2}\d\.\d{7} \(resumed here, warm-up\), ", losses)
    assert_same_checkpoint(tmp_path / "whole" / "step-00000005", killed / "step-00000005")
    assert descendants() == []


def test_a_resumed_launch_meters_without_changing_a_bit(tmp_path, capsys):
    """Only a run's step 0 counts bytes on the wire (the counted all-reduce rounds otherwise
    than Gloo's at 4 ranks); a resumed launch runs the built-ins, its bytes modeled."""
    assert train("--dp", "4", "--zero", "2", "--save", str(tmp_path / "whole")) == 0
    assert "counted on the wire" in capsys.readouterr().out
    assert train("--dp", "4", "--zero", "2", "--save", str(tmp_path / "part"),
                 "--steps", "2") == 0
    capsys.readouterr()
    assert train("--dp", "4", "--zero", "2", "--save", str(tmp_path / "part"), "--resume") == 0
    assert "built-in collectives modeled" in capsys.readouterr().out
    assert_same_checkpoint(tmp_path / "whole" / "step-00000005",
                           tmp_path / "part" / "step-00000005")


def test_keeps_the_newest_checkpoints_and_ignores_a_half_written_one(tmp_path, capsys):
    half = tmp_path / ".step-00000009.tmp"  # what a save that died midway leaves
    half.mkdir(parents=True)
    (half / "rank0-of2.pt").write_bytes(b"partial")
    assert train("--dp", "2", "--save", str(tmp_path), "--save-every", "1", "--keep",
                 "3") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000003", "step-00000004", "step-00000005"]  # the leftover removed too
    for checkpoint in complete(tmp_path):
        assert sorted(p.name for p in checkpoint.iterdir()) == [
            "manifest.json", "rank0-of2.pt", "rank1-of2.pt", "trainer.json"]


def test_the_same_command_starts_a_run_and_resumes_it(tmp_path, capsys):
    """--resume with nothing saved yet starts at step 0, as torchrun's first attempt does;
    once the run is complete it has nothing left to do."""
    assert train("--save", str(tmp_path), "--resume") == 0
    assert "resumed" not in capsys.readouterr().out
    assert train("--save", str(tmp_path), "--resume") == 0
    assert "holds all 5 steps of this run: nothing to do" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--save-every", "0", "--save", "D"],
     "--save-every (steps between checkpoints) must be a positive int, got 0"),
    (["--save-every", "2"], "--save-every needs --save DIR"),
    (["--resume"], "--resume needs --save DIR"),
    (["--save", "D", "--reshard"], "--reshard re-cuts the checkpoint --resume loads"),
    (["--save", "D", "--keep", "0"], "--keep must be a positive int, got 0"),
    (["--save", "D", "--impl", "torch", "--dp", "1"], "--save writes the engine's per-rank"),
    (["--save", "D", "--dp", "2", "--zero", "0", "--compress", "fp16", "--resume",
      "--reshard"], "not a compressor's error-feedback residual, one rank's memory of its "
                    "own gradients; this run has --compress fp16"),
    (["--kill-rank", "5", "--dp", "2"], "--kill-rank 5 is not a rank of this run (0 to 1)"),
    (["--seed", "-1"], "--seed must be an int >= 0, got -1"),
    (["--timeout", "0"], "--timeout must be a positive number, got 0.0"),
])
def test_bad_checkpoint_options_are_refused_before_any_rank_starts(args, message, capsys,
                                                                  tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert train(*args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "D").exists()


def test_resuming_another_run_is_refused_before_any_rank_starts(tmp_path, capsys):
    directory = str(tmp_path)
    assert train("--dp", "2", "--save", directory, "--steps", "2") == 0
    capsys.readouterr()
    refusals = [
        ([], "already holds checkpoints (the newest: step-00000002); pass --resume"),
        (["--resume", "--model", "small"], "was saved by a run with --model tiny, this run "
                                           "has --model small"),
        (["--resume", "--seed", "3"], "--seed 0, this run has --seed 3"),
        (["--resume", "--lr", "0.02"], "--lr 0.01, this run has --lr 0.02"),
        (["--resume", "--tp", "2", "--dp", "1"],
         "saved at dp 2 x tp 1 x pp 1, ZeRO-1, 2 micro-batches of 4, this run asks for dp 1 "
         "x tp 2 x pp 1, ZeRO-1, 2 micro-batches of 4; a sharded checkpoint fits only its own "
         "layout: pass --reshard"),
        (["--resume", "--reshard", "--tp", "2", "--dp", "1"],
         "trained on global batches of 16 sequences (dp x microbatches x micro-batch), this "
         "run's are 8"),
        (["--resume", "--steps", "0"], "--steps must be a positive int"),
    ]
    for args, message in refusals:
        assert engine_main(["train", "--dp", "2", "--save", directory, "--steps", "4",
                            *args]) == 2, args
        assert message in capsys.readouterr().err, args


def _corrupt(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _one_line(capsys) -> str:
    """What a run that stopped together printed on stderr: one line, no traceback."""
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and "Traceback" not in captured.out + captured.err, err
    return err


def test_a_missing_or_corrupted_shard_is_named(tmp_path, capsys):
    """Every rank stops together; one line names the rank and its file (exit code 2), no
    rank traceback (tests/test_train_hardening.py: --resume-fallback)."""
    directory = str(tmp_path)
    assert train("--dp", "2", "--save", directory, "--steps", "2") == 0
    capsys.readouterr()
    shard = step_dir(tmp_path, 2) / "rank1-of2.pt"
    _corrupt(shard)
    assert train("--dp", "2", "--save", directory, "--resume") == 2
    assert f"rank 1 could not load {step_dir(tmp_path, 2)}: {shard} is corrupted: its SHA-256 " \
           "does not match the manifest" in _one_line(capsys)
    shard.unlink()
    assert train("--dp", "2", "--save", directory, "--resume") == 2
    assert f"rank 1 could not load {step_dir(tmp_path, 2)}: {shard} is missing: the manifest " \
           "lists 2 rank files" in _one_line(capsys)
    assert descendants() == []


# -- expert parallelism: each rank its own experts --------------------------------------------

MOE = ["--model", "tiny-moe", "--ep", "2", "--dp", "4"]  # ep borrows 2 of dp x cp's 4 ranks


def test_moe_killed_and_resumed_equals_uninterrupted(tmp_path, capsys):
    assert train(*MOE, "--save", str(tmp_path / "whole")) == 0
    capsys.readouterr()
    killed = tmp_path / "killed"
    with pytest.raises(LaunchError, match=r"rank \d was killed by signal SIGKILL"):
        train(*MOE, "--save", str(killed), "--save-every", "2", "--kill-at-step", "3")
    assert [p.name for p in complete(killed)] == ["step-00000002"]
    capsys.readouterr()
    assert train(*MOE, "--save", str(killed), "--save-every", "2", "--resume") == 0
    assert f"resumed from {step_dir(killed, 2)} after step 2" in capsys.readouterr().out
    assert sorted(p.name for p in (killed / "step-00000005").iterdir()) == [
        "manifest.json", "rank0-of4.pt", "rank1-of4.pt", "rank2-of4.pt", "rank3-of4.pt",
        "trainer.json"]
    # the ranks hold different experts: rank 0's and rank 1's files differ, replicas' agree
    states = [read_rank_state(killed / "step-00000005", r)["model"] for r in range(4)]
    experts = [name for name in states[0] if ".experts." in name]
    assert experts and any(not torch.equal(states[0][n], states[1][n]) for n in experts)
    assert all(torch.equal(states[0][n], states[2][n]) for n in states[0])
    assert_same_checkpoint(tmp_path / "whole" / "step-00000005", killed / "step-00000005")
    assert descendants() == []


def test_a_missing_or_corrupted_moe_rank_file_is_named(tmp_path, capsys):
    directory = str(tmp_path)
    assert train(*MOE, "--save", directory, "--steps", "2") == 0
    capsys.readouterr()
    rank_file = step_dir(tmp_path, 2) / "rank2-of4.pt"
    _corrupt(rank_file)
    assert train(*MOE, "--save", directory, "--resume") == 2
    assert f"rank 2 could not load {step_dir(tmp_path, 2)}: {rank_file} is corrupted: its " \
           "SHA-256 does not match the manifest" in _one_line(capsys)
    rank_file.unlink()
    assert train(*MOE, "--save", directory, "--resume") == 2
    assert f"rank 2 could not load {step_dir(tmp_path, 2)}: {rank_file} is missing: the " \
           "manifest lists 4 rank files" in _one_line(capsys)
    assert descendants() == []


def test_an_moe_checkpoint_is_resharded_onto_more_ranks(tmp_path, capsys):
    """Once refused (the per-layout MoE trainer's files could not be re-cut): the composed
    engine joins the experts by their global index and cuts them for the new layout
    (tests/test_compose_reshard.py compares the losses with one process)."""
    directory = str(tmp_path)
    assert train("--model", "tiny-moe", "--dp", "2", "--save", directory, "--steps", "2") == 0
    capsys.readouterr()
    assert engine_main(["train", "--steps", "3", "--model", "tiny-moe", "--dp", "4",
                        "--microbatches", "1", "--save", directory, "--resume",
                        "--reshard"]) == 0
    assert "(re-cut for this layout)" in capsys.readouterr().out
