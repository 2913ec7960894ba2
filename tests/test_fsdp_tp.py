"""FSDP2 + tensor parallelism (2D) on the composed engine's mesh: the GPT of engine.compose
split by ``apply_tensor_parallel`` over ``mesh.tp_group``, then each block and the root
sharded by ``engine.fsdp.fully_shard`` over ``mesh.dp_group`` (each rank's TP slice cut again
on dim 0, as PyTorch's FSDP2 shards a TP DTensor), trained as one process at dp=2, tp=2."""

from __future__ import annotations

import contextlib

import pytest
import torch

from engine.compose.loop import train
from engine.compose.model import GPT
from engine.compose.parallelize import Parallel, apply_tensor_parallel
from engine.compose.parity import MODEL, OPTIMIZERS, ROWS, SEED, STEPS, reference
from engine.compose.plan import Plan
from engine.compose.state import join_tp
from engine.fsdp import fully_shard, gather_full
from engine.topology import Mesh
from tests.helpers import run_ranks

pytestmark = pytest.mark.filterwarnings("error")


def _two_d(rank, world_size, optimizer_name):
    plan = Plan(dp=2, tp=2)
    mesh = Mesh(dp=plan.dp, tp=plan.tp)
    model = GPT(MODEL, seed=SEED)
    apply_tensor_parallel(model, mesh)
    for block in model.blocks:
        fully_shard(block, mesh.dp_group)
    fully_shard(model, mesh.dp_group)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    optimizer_cls, kwargs = OPTIMIZERS[optimizer_name]
    # fully_shard's reduce-scatter averages over the dp ranks: what DataParallel does
    par = Parallel(model, model, optimizer_cls(model.parameters(), **kwargs), mesh, plan,
                   contextlib.nullcontext, mesh.tp_group, replicas=mesh.dp)
    losses = train(par, STEPS, ROWS, seed=SEED + 1)
    state = {name: join_tp(name, gather_full(p, mesh.dp_group), par)
             for name, p in model.named_parameters(remove_duplicate=False)}
    return losses, state, shapes


@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
def test_fully_shard_over_dp_of_a_tensor_parallel_gpt_equals_one_process(optimizer_name):
    single = reference(MODEL, varlen=False, optimizer_name=optimizer_name)
    for rank, (losses, state, shapes) in enumerate(run_ranks(_two_d, 4, optimizer_name)):
        worst = max((state[n] - p).abs().max().item() for n, p in single["state"].items())
        print(f"rank {rank}: losses {losses} vs {single['losses']}; worst |param| {worst:.2e}")
        assert state.keys() == single["state"].keys()
        # other reduction orders (tp all-reduces, dp reduce-scatter): within 1e-6, not bits
        assert losses == pytest.approx(single["losses"], rel=1e-6) and worst <= 1e-6
        # fc.weight [4h, h]: 128 rows, tp=2 -> 64, dp=2 -> 32 rows on each rank
        assert shapes["blocks.0.fc.weight"] == (4 * MODEL.hidden // 4, MODEL.hidden)
