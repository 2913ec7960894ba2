"""Sharded ZeRO checkpoints: resume bit for bit, consolidate to a plain state_dict, and refuse
a wrong world size or a corrupted file with a clear error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.models import MLP, GPTConfig, TinyGPT, regression_data, shard
from engine.zero import (CheckpointError, ZeroDataParallel, ZeroOptimizer, consolidate,
                         load_sharded, save_sharded)
from tests.helpers import run_ranks

SIZES = (16, 33, 31, 8)


def _build(stage, seed=2):
    module = MLP(SIZES, seed=seed)
    if stage == 3:
        model = ZeroDataParallel(module, torch.optim.AdamW, lr=1e-2)
        return model, model.optimizer, None
    opt = ZeroOptimizer(module.parameters(), torch.optim.AdamW, stage=stage, lr=1e-2,
                        bucket_cap_mb=0.001)
    return module, opt, opt


def _params(model):
    if isinstance(model, ZeroDataParallel):
        for unit in model.all_units:
            unit.start_gather(None)
            unit.finish_gather()
        model = model.module
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _train(model, opt, xs, ys, steps):
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()


def _resume(rank, world_size, stage, directory):
    x, y = regression_data(8 * world_size, 16, 8, seed=1)
    xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
    model, opt, zero_opt = _build(stage)
    _train(model, opt, xs, ys, 5)
    uninterrupted = _params(model)

    model, opt, zero_opt = _build(stage)
    _train(model, opt, xs, ys, 2)
    save_sharded(directory, model, zero_opt)
    model, opt, zero_opt = _build(stage, seed=99)  # a fresh run with other weights
    load_sharded(directory, model, zero_opt)
    _train(model, opt, xs, ys, 3)
    return torch.equal(_params(model), uninterrupted), _params(model)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resuming_from_a_sharded_checkpoint_is_bit_identical(stage, tmp_path):
    for identical, _ in run_ranks(_resume, 3, stage, tmp_path):
        assert identical
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["manifest.json", "rank0-of3.pt", "rank1-of3.pt", "rank2-of3.pt"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_consolidated_state_dict_loads_into_the_plain_model(stage, tmp_path):
    results = run_ranks(_resume, 2, stage, tmp_path)
    _, trained = results[0]
    # the checkpoint holds the state after 2 steps: redo those 2 steps on one process
    state = consolidate(tmp_path)
    plain = MLP(SIZES)
    plain.load_state_dict(state)  # strict: every key, every shape
    assert set(state) == set(plain.state_dict())
    reference = run_ranks(_two_steps_params, 2, stage)[0]
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in plain.parameters()]),
                       reference)


def _two_steps_params(rank, world_size, stage):
    x, y = regression_data(8 * world_size, 16, 8, seed=1)
    xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
    model, opt, _ = _build(stage)
    _train(model, opt, xs, ys, 2)
    return _params(model)


def _gpt_checkpoint(rank, world_size, directory):
    config = GPTConfig(vocab=32, seq_len=8, layers=2, heads=2, hidden=16)
    inner = TinyGPT(config, seed=0)
    model = ZeroDataParallel(inner, torch.optim.AdamW, units=inner.blocks, lr=1e-2)
    save_sharded(directory, model)


def test_tied_embeddings_come_back_under_both_names(tmp_path):
    run_ranks(_gpt_checkpoint, 2, tmp_path)
    state = consolidate(tmp_path)
    config = GPTConfig(vocab=32, seq_len=8, layers=2, heads=2, hidden=16)
    plain = TinyGPT(config, seed=5)
    plain.load_state_dict(state)
    assert plain.head.weight is plain.tok.weight
    assert torch.equal(plain.tok.weight, TinyGPT(config, seed=0).tok.weight)


def _save_then_load(rank, world_size, directory, load):
    model, opt, zero_opt = _build(2)
    if load:
        load_sharded(directory, model, zero_opt)
    else:
        save_sharded(directory, model, zero_opt)


def test_a_different_world_size_is_a_clear_error(tmp_path):
    run_ranks(_save_then_load, 3, tmp_path, False)
    with pytest.raises(Exception, match="saved by 3 ranks and this run has 2"):
        run_ranks(_save_then_load, 2, tmp_path, True)


def test_a_corrupted_file_is_a_clear_error(tmp_path):
    run_ranks(_save_then_load, 2, tmp_path, False)
    path = tmp_path / "rank1-of2.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rank1-of2.pt is corrupted"):
        consolidate(tmp_path)
    with pytest.raises(Exception, match="rank1-of2.pt is corrupted"):
        run_ranks(_save_then_load, 2, tmp_path, True)
    (tmp_path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="not a sharded checkpoint directory"):
        consolidate(tmp_path)
