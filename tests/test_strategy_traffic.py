"""engine.train.timed_steps names every strategy's bytes with the one classifier,
:func:`engine.compose.traffic.report_traffic`: the loop has no bookkeeper per engine."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.comm import ops
from engine.compose.traffic import bytes_by_kind
from engine.observe.meter import CommMeter
from engine.topology import Mesh
from engine.train import timed_steps
from tests.helpers import run_ranks


class _AllReduces:
    """A strategy whose step all-reduces 4 floats over dp: PyTorch's DDP sends this way."""

    def __init__(self, mesh: Mesh):
        self.mesh, self.groups, self.device = mesh, {}, torch.device("cpu")

    def step(self, k):
        ops.all_reduce(torch.ones(4), group=self.mesh.dp_group)
        return SimpleNamespace(loss=0.0, events=[])


def _run(rank, world_size):
    return timed_steps.run_steps(_AllReduces(Mesh(dp=world_size)), steps=1, warmup=1).traffic


def test_run_steps_names_the_bytes_by_the_group_they_crossed():
    # a ring all-reduce of 16 B over 2 ranks sends 2(2-1)/2 x 16 = 16 B a rank
    assert run_ranks(_run, 2) == [{"dp": 16}, {"dp": 16}]


def _embedding_apart(rank, world_size):
    mesh = Mesh(pp=2)
    with CommMeter(count="wire") as meter:
        ops.all_reduce(torch.ones(4), group=mesh.embedding_group)  # the tied embedding's sum
        ops.broadcast(torch.ones(2), src=1, group=mesh.pp_group)  # the loss, to every stage
    return (rank, bytes_by_kind(meter.events, mesh, moe=False),
            bytes_by_kind(meter.events, mesh, moe=False, embedding=True))


def test_the_tied_embeddings_sum_is_pp_or_a_kind_of_its_own():
    """Chapter 07 shows the embedding's sum apart from the activations; engine train counts
    it as pp. The loss's broadcast on the same two ranks stays pp either way."""
    for rank, plain, apart in run_ranks(_embedding_apart, 2):
        assert plain["pp"] == apart["pp"] + apart["embedding"]
        # 16 B all-reduced over 2 ranks: 16 B a rank; a broadcast of 8 B: the root sends them
        assert apart["embedding"] == 16 and apart["pp"] == (8 if rank == 1 else 0)
