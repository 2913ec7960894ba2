"""Resharding through ``engine train --resume --reshard``: a checkpoint saved at one layout
(dp = 4 at ZeRO-3) continues at another (dp 2 x tp 2 at ZeRO-1), as the uninterrupted run;
what cannot be done is a clear error. Every run is the composed engine's; the offline join
and cut are tested in tests/test_compose_reshard.py."""

from __future__ import annotations

import json

import pytest

from engine.__main__ import main as engine_main
from engine.checkpoint.trainer import step_dir


def _train(*args) -> None:
    assert engine_main(["train", "--steps", "3", *args]) == 0


def test_resuming_on_another_layout_continues_the_run(tmp_path, capsys):
    """dp 4 at ZeRO-3, stopped after 3 steps, resumed as dp 2 x tp 2 at ZeRO-1 with the same
    global batch (4 micro-batches of 4 per dp rank): the run goes on as if uninterrupted, up
    to the order of floating-point sums (dp and tp reduce in other orders)."""
    _train("--dp", "4", "--zero", "3", "--steps", "5", "--save", str(tmp_path / "whole"))
    _train("--dp", "4", "--zero", "3", "--save", str(tmp_path / "run"))
    capsys.readouterr()
    assert engine_main(["train", "--dp", "2", "--tp", "2", "--zero", "1", "--microbatches", "4",
                        "--steps", "5", "--save", str(tmp_path / "run"), "--resume",
                        "--reshard"]) == 0
    assert "(re-cut for this layout)" in capsys.readouterr().out

    def losses(run):
        return json.loads((step_dir(tmp_path / run, 5) / "trainer.json").read_text())["losses"]

    assert losses("run")[:3] == losses("whole")[:3]  # from the checkpoint, as saved
    assert losses("run")[3:] == pytest.approx(losses("whole")[3:], rel=1e-6)
    # (the parameters are not compared after the resume: the key bias's true gradient is 0,
    # so AdamW normalises rounding noise into its updates, and sums in another order move it
    # by up to ~1e-5; the loaded state itself is exact, as the tests above show)


def test_an_impossible_reshard_is_a_clear_error(tmp_path, capsys):
    _train("--dp", "2", "--zero", "1", "--save", str(tmp_path))
    capsys.readouterr()
    # another model: refused before any rank starts, naming the flag
    assert engine_main(["train", "--steps", "4", "--save", str(tmp_path), "--resume",
                        "--reshard", "--dp", "2", "--model", "small"]) == 2
    assert "was saved by a run with --model tiny, this run has --model small" in \
        capsys.readouterr().err
    # a layout the model cannot take is refused before any rank starts
    for layout, message in ((["--pp", "3", "--dp", "1", "--microbatches", "4"],
                             "pp = 3 pipeline stages need at least 3 layers, the model has 2"),
                            (["--tp", "3", "--dp", "1"], "tp = 3 must divide")):
        assert engine_main(["train", "--steps", "4", "--save", str(tmp_path), "--resume",
                            "--reshard", *layout]) == 2
        assert message in capsys.readouterr().err
