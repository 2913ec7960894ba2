"""engine.checkpoint.per_rank: every rank's own state back bit for bit, and a checkpoint that does
not fit refused by name on every rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.checkpoint.per_rank import load_per_rank, read_rank_state, save_per_rank
from engine.zero.checkpoint import CheckpointError
from tests.helpers import run_ranks


def _model(rank, width=None, seed=None):
    torch.manual_seed(rank if seed is None else seed)
    return nn.Linear(4, width or 3 + rank)  # the ranks hold different parameters


def _step(model, opt):
    model(torch.linspace(-1, 1, 8).view(2, 4)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _save_then_load(rank, world_size, directory, width=None):
    model = _model(rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt)
    save_per_rank(directory, model, opt)
    again = _model(rank, width and width + rank, seed=10 + rank)  # other values
    opt_again = torch.optim.AdamW(again.parameters(), lr=1e-2)
    try:
        load_per_rank(directory, again, opt_again)
    except CheckpointError as e:
        return str(e)
    _step(model, opt)
    _step(again, opt_again)
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_each_rank_gets_its_own_state_back(tmp_path):
    assert run_ranks(_save_then_load, 2, str(tmp_path)) == [True, True]
    assert read_rank_state(tmp_path, 1)["model"]["weight"].shape == (4, 4)


def test_another_model_is_refused_on_every_rank(tmp_path):
    messages = run_ranks(_save_then_load, 2, str(tmp_path), 5)
    assert "rank 0's model does not match the checkpoint: weight is (3, 4) in the " \
           "checkpoint and (5, 4) here" in messages[0]
    assert messages[1].startswith("rank 1's model does not match")


def _load_only(rank, world_size, directory):
    model = _model(rank)
    try:
        load_per_rank(directory, model, torch.optim.AdamW(model.parameters()))
    except CheckpointError as e:
        return str(e)


def test_another_world_size_and_a_zero_checkpoint_are_refused(tmp_path):
    run_ranks(_save_then_load, 2, str(tmp_path))
    assert "saved by 2 ranks and this run has 1" in run_ranks(_load_only, 1, str(tmp_path))[0]
    (tmp_path / "manifest.json").write_text('{"format": 2}')
    assert "is not a per-rank checkpoint" in run_ranks(_load_only, 2, str(tmp_path))[0]
    run_ranks(_save_then_load, 2, str(tmp_path))
    with pytest.raises(CheckpointError, match="was saved by 2 ranks; there is no rank 5"):
        read_rank_state(tmp_path, 5)


def _load_with_groups(rank, world_size, directory, split_on):
    model = _model(rank)
    params = list(model.parameters())
    groups = [{"params": params[:1]}, {"params": params[1:]}] if rank == split_on else params
    try:
        load_per_rank(directory, model, torch.optim.AdamW(groups))
    except CheckpointError as e:
        return str(e)


def test_an_error_on_one_rank_reaches_every_rank(tmp_path):
    run_ranks(_save_then_load, 2, str(tmp_path))
    # rank 1's optimizer has two parameter groups where one was saved: torch's ValueError
    mine, theirs = run_ranks(_load_with_groups, 2, str(tmp_path), 1)[::-1]
    assert mine.startswith("rank 1 could not load") and "ValueError" in mine
    assert theirs.startswith("rank 1 cannot load: rank 1 could not load")


def test_a_damaged_manifest_is_named(tmp_path):
    import json

    run_ranks(_save_then_load, 2, str(tmp_path))
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    del manifest["files"]["rank1-of2.pt"]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    for message in run_ranks(_load_only, 2, str(tmp_path)):
        assert "manifest.json is damaged: it should list 2 rank files" in message
