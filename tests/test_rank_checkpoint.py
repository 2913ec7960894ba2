"""engine.checkpoint.per_rank: every rank's own state back bit for bit, and a checkpoint that does
not fit refused by name on every rank. A ZeRO-3 run's files (the composed engine's, as engine
train and chapter 04 write them): each rank's holds its shard, 12 bytes a parameter with fp32
AdamW; written on GPUs, they open, resume and join on a machine without one; joined offline
they are the plain model's state_dict, bit for bit. A save that dies midway never looks
complete."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from engine.checkpoint.files import MANIFEST, CheckpointError
from engine.checkpoint.per_rank import load_per_rank, read_rank_state, save_per_rank
from engine.compose.loop import train_step
from engine.compose.model import GPT, ModelConfig
from engine.compose.parallelize import parallelize
from engine.compose.plan import Plan
from engine.compose.reshard import universal_state
from engine.compose.resume import rank_state
from engine.compose.state import dense_state
from engine.model.data import global_batch
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


def test_another_world_size_and_another_kind_of_checkpoint_are_refused(tmp_path):
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


# -- ZeRO-3: no rank holds the whole model ----------------------------------------------------
#
# torch.save records, for every storage, the device it was saved from ("cuda:3"), and torch.load
# puts it back there unless told otherwise (map_location). A GPU rank's file differs from a CPU
# rank's in exactly that tag. No GPU here, so the ranks below save through
# torch.serialization.location_tag answering "cuda:<rank>", as it does for a tensor on that
# GPU: the files are those a GPU run writes. Without map_location, loading one on this machine
# fails ("Attempting to deserialize object on a CUDA device").

CFG = ModelConfig(vocab=64, seq_len=16, layers=2, heads=4, hidden=32)  # tied embedding


def _zero3(world_size, seed):
    plan = Plan(dp=world_size, zero=3)
    return parallelize(GPT(CFG, seed=seed), plan.mesh(), plan, torch.optim.AdamW, lr=1e-2)


def _steps(par, first, last):
    return [train_step(par, global_batch(k, 4, CFG.seq_len, CFG.vocab, 1), k)
            for k in range(first, last)]


def _zero3_on_gpus(rank, world_size, directory):
    run = _zero3(world_size, seed=0)
    _steps(run, 0, 2)
    tag = torch.serialization.location_tag
    torch.serialization.location_tag = lambda storage: f"cuda:{rank}"
    try:
        save_per_rank(directory, *rank_state(run))
    finally:
        torch.serialization.location_tag = tag
    saved = dense_state(run)
    shard = sum(p.numel() for p in run.model.parameters())
    straight = _steps(run, 2, 4)
    again = _zero3(world_size, seed=1)  # other weights
    load_per_rank(directory, *rank_state(again))
    resumed = _steps(again, 2, 4)
    same = all(torch.equal(a, b) for a, b in zip(dense_state(run).values(),
                                                 dense_state(again).values(), strict=True))
    return saved, shard, resumed == straight and same


def _unique_elements(state: dict) -> int:
    """Elements of the distinct tensors (a tied weight, saved once, counted once)."""
    return sum({(t.untyped_storage().data_ptr(), t.storage_offset(), t.shape): t.numel()
                for t in state.values()}.values())


def test_a_zero3_run_saved_on_gpus_resumes_and_joins_into_the_plain_model_on_the_cpu(tmp_path):
    n = 2
    results = run_ranks(_zero3_on_gpus, n, str(tmp_path))
    assert all(resumed for _, _, resumed in results)  # bit for bit, on the same ranks
    saved = results[0][0]
    psi = sum(p.numel() for p in GPT(CFG).parameters())
    assert [shard for _, shard, _ in results] == [psi // n] * n  # no rank holds the model
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST, "rank0-of2.pt",
                                                          "rank1-of2.pt"]
    assert b"cuda:1" in (tmp_path / "rank1-of2.pt").read_bytes()
    for rank in range(n):  # its shard and AdamW's two moments of it: 12 bytes a parameter
        state = read_rank_state(tmp_path, rank)
        assert _unique_elements(state["model"]) == psi // n
        moments = [t for s in state["optimizer"]["optimizers"][0]["state"].values()
                   for key, t in s.items() if key != "step"]
        assert sum(t.numel() for t in moments) == 2 * psi // n
        assert {t.device.type for t in moments} == {"cpu"}
    joined = universal_state(tmp_path, CFG)
    plain = GPT(CFG, seed=5)
    plain.load_state_dict(joined.params)  # strict: every key, every shape
    assert plain.head.weight is plain.tok.weight
    assert plain.state_dict().keys() == saved.keys()
    assert all(torch.equal(plain.state_dict()[k], saved[k]) for k in saved)
    assert {t.device.type for t in joined.params.values()} == {"cpu"}


# -- crash safety ------------------------------------------------------------------------------


def _save_and_die_before_the_rename(rank, world_size, directory):
    model = _model(rank, seed=7)
    if rank == 1:  # this rank's process dies once its file is written, before it is in place
        os.replace = lambda *args: os._exit(1)
    save_per_rank(directory, model, torch.optim.AdamW(model.parameters()))


def test_a_save_that_dies_midway_never_looks_complete(tmp_path):
    run_ranks(_save_then_load, 2, str(tmp_path))  # an earlier, complete checkpoint
    before = (tmp_path / "rank1-of2.pt").read_bytes()
    with pytest.raises(Exception, match="rank 1"):
        run_ranks(_save_and_die_before_the_rename, 2, str(tmp_path))
    # under its own name, the dead rank's file is still the old whole one, not half a new one
    assert (tmp_path / "rank1-of2.pt").read_bytes() == before
    with pytest.raises(CheckpointError, match="manifest.json does not exist"):
        read_rank_state(tmp_path, 0)
    assert run_ranks(_load_only, 2, str(tmp_path))[0].endswith(
        "manifest.json does not exist: not a per-rank checkpoint directory, or a save that "
        "did not finish (the manifest is written last)")
