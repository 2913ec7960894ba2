"""Sharded ZeRO checkpoints: resume bit for bit (alone and inside a dp x tp x pp mesh),
consolidate to a plain state_dict, open a GPU run's files on the CPU, and refuse a wrong
layout, a missing or a corrupted file, or a save that did not finish, with a clear error."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from engine.model.mlp import MLP
from engine.model.gpt import GPTConfig, TinyGPT
from engine.model.data import regression_data, shard
from engine.pp import gpipe, run_pipeline
from engine.topology import Mesh
from engine.tp.layers import ColumnParallelLinear, RowParallelLinear
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


# -- inside a dp x tp x pp mesh: each data-parallel group saves its own part -------------------

WIDTH = 8
MICRO_BATCHES = 2


def _mesh_part(mesh, seed):
    """This rank's part of the model: pipeline stage ``pp`` is an MLP block cut over the
    tensor-parallel group (column- then row-parallel), from a dense block of its own seed."""
    dense = MLP((WIDTH, 4 * WIDTH, WIDTH), seed=seed + mesh.coords.pp)
    return nn.Sequential(
        ColumnParallelLinear.from_dense(dense.net[0], group=mesh.tp_group, gather_output=False),
        nn.GELU(),
        RowParallelLinear.from_dense(dense.net[2], group=mesh.tp_group, input_is_parallel=True))


def _build_in_mesh(mesh, stage, seed):
    module = _mesh_part(mesh, seed)
    if stage == 3:
        model = ZeroDataParallel(module, torch.optim.AdamW, group=mesh.dp_group, lr=1e-2)
        return model, model.optimizer, None
    opt = ZeroOptimizer(module.parameters(), torch.optim.AdamW, stage=stage, group=mesh.dp_group,
                        lr=1e-2, bucket_cap_mb=0.0005)  # several buckets per part
    return module, opt, opt


def _train_in_mesh(mesh, model, opt, steps):
    """``steps`` steps of the pipeline (GPipe over the pp group), each dp rank on its slice."""
    x, y = regression_data(mesh.dp * MICRO_BATCHES * 2, WIDTH, WIDTH, seed=1)
    xs, ys = shard(x, mesh.coords.dp, mesh.dp), shard(y, mesh.coords.dp, mesh.dp)
    plan = gpipe(mesh.pp, MICRO_BATCHES)
    for _ in range(steps):
        opt.zero_grad()
        run_pipeline([model], plan, list(xs.chunk(MICRO_BATCHES)),
                     list(ys.chunk(MICRO_BATCHES)), stage=mesh.coords.pp, group=mesh.pp_group)
        opt.step()


def _whole_part(model):
    """Every parameter of this rank's part, whole (stage 3's units gathered), by name."""
    if not isinstance(model, ZeroDataParallel):
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    for unit in model.all_units:
        unit.start_gather(model.group)
        unit.finish_gather()
    state = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    for unit in model.all_units:
        unit.free()
    return state


def _same(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _resume_in_mesh(rank, world_size, dp, tp, pp, stage, directory):
    mesh = Mesh(dp=dp, tp=tp, pp=pp)
    model, opt, zero_opt = _build_in_mesh(mesh, stage, seed=2)
    _train_in_mesh(mesh, model, opt, 2)
    save_sharded(directory, model, zero_opt, mesh=mesh)
    saved = _whole_part(model)
    _train_in_mesh(mesh, model, opt, 2)
    uninterrupted = _whole_part(model)

    model, opt, zero_opt = _build_in_mesh(mesh, stage, seed=99)  # other weights
    load_sharded(directory, model, zero_opt, mesh=mesh)
    _train_in_mesh(mesh, model, opt, 2)
    resumed = _whole_part(model)
    return mesh.coords, _same(resumed, uninterrupted), saved


def _part_files(dp, tp, pp):
    return {f"tp{t}-pp{p}-rank{d}-of{dp}.pt"
            for t in range(tp) for p in range(pp) for d in range(dp)}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dp, tp, pp", [(2, 2, 1), (2, 2, 2)])
def test_resuming_inside_a_mesh_is_bit_identical(dp, tp, pp, stage, tmp_path):
    results = run_ranks(_resume_in_mesh, dp * tp * pp, dp, tp, pp, stage, tmp_path)
    for coords, identical, _ in results:
        assert identical, coords
    assert {p.name for p in tmp_path.iterdir()} == _part_files(dp, tp, pp) | {"manifest.json"}
    # each part consolidates to what its dp group held when it saved
    for coords, _, saved in results:
        assert _same(consolidate(tmp_path, tp=coords.tp, pp=coords.pp), saved), coords


def _save_in_mesh(rank, world_size, dp, tp, pp, stage, directory):
    mesh = Mesh(dp=dp, tp=tp, pp=pp)
    model, opt, zero_opt = _build_in_mesh(mesh, stage, seed=2)
    _train_in_mesh(mesh, model, opt, 1)
    save_sharded(directory, model, zero_opt, mesh=mesh)
    return _whole_part(model)


def _load_in_mesh(rank, world_size, dp, tp, pp, stage, directory):
    mesh = Mesh(dp=dp, tp=tp, pp=pp)
    model, _, zero_opt = _build_in_mesh(mesh, stage, seed=99)
    load_sharded(directory, model, zero_opt, mesh=mesh)
    return _whole_part(model)


def test_a_checkpoint_of_another_layout_is_a_clear_error(tmp_path):
    run_ranks(_save_in_mesh, 4, 2, 2, 1, 2, tmp_path)
    # the same 4 ranks, laid out as dp = 4: the world size alone would not tell
    with pytest.raises(Exception, match=r"saved by 4 ranks and this run has 4, laid out "
                                        r"dp x tp x pp = 2 x 2 x 1 then and 4 x 1 x 1 now"):
        run_ranks(_load_in_mesh, 4, 4, 1, 1, 2, tmp_path)
    with pytest.raises(Exception, match="saved at stage 2, this run is at stage 1"):
        run_ranks(_load_in_mesh, 4, 2, 2, 1, 1, tmp_path)
    with pytest.raises(CheckpointError, match=r"2 model parts \(tp = 2, pp = 1\): pass tp= "
                                              "and pp= to choose one"):
        consolidate(tmp_path)
    with pytest.raises(ValueError, match="tp=2 is outside this checkpoint's tp = 2"):
        consolidate(tmp_path, tp=2, pp=0)


def _load_other_model(rank, world_size, directory):
    mesh = Mesh(dp=2, tp=2, pp=1)
    module = _mesh_part(mesh, seed=2)
    opt = ZeroOptimizer(module.parameters(), torch.optim.AdamW, stage=2, group=mesh.dp_group,
                        lr=1e-2)  # one bucket where the checkpoint has several
    load_sharded(directory, module, opt, mesh=mesh)


def test_a_checkpoint_of_another_bucketing_is_a_clear_error(tmp_path):
    run_ranks(_save_in_mesh, 4, 2, 2, 1, 2, tmp_path)
    with pytest.raises(Exception, match=r"part tp\d-pp0 does not match this model: \d+ "
                                        r"buckets in the checkpoint, 1 here"):
        run_ranks(_load_other_model, 4, tmp_path)


def test_a_missing_file_in_a_mesh_is_a_clear_error(tmp_path):
    run_ranks(_save_in_mesh, 4, 2, 2, 1, 1, tmp_path)
    (tmp_path / "tp1-pp0-rank1-of2.pt").unlink()
    with pytest.raises(CheckpointError, match=r"tp1-pp0-rank1-of2.pt is missing: the manifest "
                                              r"lists 4 shard files \(dp x tp x pp = 2 x 2 x 1"):
        consolidate(tmp_path, tp=1, pp=0)
    assert consolidate(tmp_path, tp=0, pp=0)  # the other part is whole
    with pytest.raises(Exception, match="tp1-pp0-rank1-of2.pt is missing"):
        run_ranks(_load_in_mesh, 4, 2, 2, 1, 1, tmp_path)


def test_a_corrupted_byte_in_a_mesh_is_a_clear_error(tmp_path):
    run_ranks(_save_in_mesh, 4, 2, 2, 1, 3, tmp_path)
    path = tmp_path / "tp0-pp0-rank1-of2.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="tp0-pp0-rank1-of2.pt is corrupted: its SHA-256 "
                                              "does not match the manifest"):
        consolidate(tmp_path, tp=0, pp=0)
    with pytest.raises(Exception, match="tp0-pp0-rank1-of2.pt is corrupted"):
        run_ranks(_load_in_mesh, 4, 2, 2, 1, 3, tmp_path)


def _save_with_a_subgroup(rank, world_size, directory, mesh_given):
    mesh = Mesh(dp=2, tp=2, pp=1)
    model, _, zero_opt = _build_in_mesh(mesh, 1, seed=2)
    save_sharded(directory, model, zero_opt, mesh=Mesh(dp=4) if mesh_given else None)


def test_a_data_parallel_subgroup_needs_its_mesh(tmp_path):
    with pytest.raises(Exception, match=r"data-parallel group holds ranks \([0-3], [0-3]\) of 4: "
                                        "pass mesh="):
        run_ranks(_save_with_a_subgroup, 4, tmp_path, False)
    with pytest.raises(Exception, match=r"mesh's data-parallel group \(0, 1, 2, 3\) is not the "
                                        r"optimizer's \([0-3], [0-3]\)"):
        run_ranks(_save_with_a_subgroup, 4, tmp_path, True)


# -- devices: a checkpoint written on GPUs opens on a machine without one ----------------------
#
# torch.save records, for every storage, the device it was saved from ("cuda:3"), and torch.load
# puts it back there unless told otherwise (map_location). A GPU rank's shard file differs from
# a CPU rank's in exactly that tag. No GPU here, so the ranks below save through
# torch.serialization.location_tag answering "cuda:<rank>", as it does for a tensor on that
# GPU: the files are those a GPU run writes. Without map_location, loading one on this machine
# fails ("Attempting to deserialize object on a CUDA device"); with it, the tensors come back
# on the CPU (consolidate) or on the rank's own device (load_sharded).


def _save_as_if_on_gpus(rank, world_size, stage, directory):
    x, y = regression_data(8 * world_size, 16, 8, seed=1)
    model, opt, zero_opt = _build(stage)
    _train(model, opt, shard(x, rank, world_size), shard(y, rank, world_size), 2)
    tag = torch.serialization.location_tag
    torch.serialization.location_tag = lambda storage: f"cuda:{rank}"
    try:
        save_sharded(directory, model, zero_opt)
    finally:  # the result handed back to the caller is an ordinary CPU tensor
        torch.serialization.location_tag = tag
    return _params(model)


def _load_on_cpu_and_train(rank, world_size, stage, directory):
    x, y = regression_data(8 * world_size, 16, 8, seed=1)
    model, opt, zero_opt = _build(stage, seed=99)
    load_sharded(directory, model, zero_opt)
    _train(model, opt, shard(x, rank, world_size), shard(y, rank, world_size), 3)
    return _params(model)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_checkpoint_saved_on_gpus_consolidates_and_loads_on_the_cpu(stage, tmp_path):
    saved = run_ranks(_save_as_if_on_gpus, 2, stage, tmp_path)[0]
    data = (tmp_path / "rank1-of2.pt").read_bytes()
    assert b"cuda:1" in data  # the files say where their tensors lived
    state = consolidate(tmp_path)
    assert {t.device.type for t in state.values()} == {"cpu"}
    assert torch.equal(torch.cat([state[n].reshape(-1) for n, _ in
                                  MLP(SIZES).named_parameters()]), saved)
    resumed = run_ranks(_load_on_cpu_and_train, 2, stage, tmp_path)
    uninterrupted = run_ranks(_resume, 2, stage, tmp_path / "reference")
    for (_, expected), got in zip(uninterrupted, resumed, strict=True):
        assert torch.equal(got, expected)


# -- crash safety ------------------------------------------------------------------------------


def _save_and_die_before_the_rename(rank, world_size, directory):
    model, _, zero_opt = _build(2, seed=7)
    if rank == 1:  # this rank's process dies once its shard is written, before it is in place
        os.replace = lambda *args: os._exit(1)
    save_sharded(directory, model, zero_opt)


def test_a_save_that_dies_midway_never_looks_complete(tmp_path):
    run_ranks(_save_then_load, 2, tmp_path, False)  # an earlier, complete checkpoint
    assert consolidate(tmp_path)
    before = (tmp_path / "rank1-of2.pt").read_bytes()
    with pytest.raises(Exception, match="rank 1"):
        run_ranks(_save_and_die_before_the_rename, 2, tmp_path)
    # under its own name, the dead rank's file is still the old whole one, not half a new one
    assert (tmp_path / "rank1-of2.pt").read_bytes() == before
    with pytest.raises(CheckpointError, match="manifest.json does not exist"):
        consolidate(tmp_path)
    with pytest.raises(Exception, match="manifest.json does not exist"):
        run_ranks(_save_then_load, 2, tmp_path, True)


# -- fp32 masters: bf16 parameters, and offloaded optimizer state ----------------------------


def _resume_with_masters(rank, world_size, stage, dtype, offload, directory):
    """As ``_resume``, where the optimizer updates a separate fp32 master copy (bf16
    parameters, or masters offloaded to the CPU): the masters must come back too."""
    x, y = regression_data(8 * world_size, 16, 8, seed=1)
    xs, ys = shard(x, rank, world_size).to(dtype), shard(y, rank, world_size).to(dtype)

    def build(seed):
        module = MLP(SIZES, seed=seed).to(dtype)
        if stage == 3:
            model = ZeroDataParallel(module, torch.optim.AdamW, lr=1e-2)
            return model, model.optimizer, None
        opt = ZeroOptimizer(module.parameters(), torch.optim.AdamW, stage=stage, lr=1e-2,
                            bucket_cap_mb=0.001, offload=offload)
        return module, opt, opt

    model, opt, _ = build(2)
    _train(model, opt, xs, ys, 5)
    uninterrupted = _params(model)
    model, opt, zero_opt = build(2)
    _train(model, opt, xs, ys, 2)
    save_sharded(directory, model, zero_opt)
    model, opt, zero_opt = build(99)
    load_sharded(directory, model, zero_opt)
    _train(model, opt, xs, ys, 3)
    return torch.equal(_params(model), uninterrupted)


@pytest.mark.parametrize("stage, dtype, offload", [
    (1, torch.bfloat16, False), (2, torch.bfloat16, False), (3, torch.bfloat16, False),
    (1, torch.float32, True), (2, torch.float32, True)])
def test_resuming_restores_the_fp32_masters(stage, dtype, offload, tmp_path):
    assert all(run_ranks(_resume_with_masters, 2, stage, dtype, offload, tmp_path))


# -- what a rank writes: its shard, 12 bytes per parameter with fp32 AdamW ---------------------


def _trained_checkpoint(rank, world_size, stage, directory):
    x, y = regression_data(8 * world_size, 16, 8, seed=1)
    model, opt, zero_opt = _build(stage)
    _train(model, opt, shard(x, rank, world_size), shard(y, rank, world_size), 1)
    save_sharded(directory, model, zero_opt)
    buckets = model.all_units if stage == 3 else zero_opt.buckets
    return [b.padded for b in buckets]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_rank_writes_12_bytes_per_parameter_of_its_shard(stage, tmp_path):
    """fp32 parameters are their own masters (ZeroOptimizer and ZeroDataParallel update the
    shard in place), so a file holds the shard once, and AdamW's two moments: (4 + 8) Ψ / N,
    padding included, plus AdamW's 4-byte step count per bucket. (Writing the masters as well
    used to make it 16.)"""
    n = 3
    padded = run_ranks(_trained_checkpoint, n, stage, tmp_path)[0]
    for rank in range(n):
        payload = torch.load(tmp_path / f"rank{rank}-of{n}.pt", weights_only=True)
        tensors = [*payload["shards"], *(m for m in payload["masters"] if m is not None),
                   *(v for s in payload["optimizer"]["state"].values() for v in s.values())]
        assert sum(t.nbytes for t in tensors) == sum(12 * p // n + 4 for p in padded)
