"""engine.topology.Mesh and 3D training: dp x tp x pp (+ ZeRO-1) equals one process."""

from __future__ import annotations

import pytest

from engine.comm import ops
from engine.labs.hybrid import train_3d, train_reference
from engine.model.gpt import GPTConfig
from engine.topology import Mesh
from tests.helpers import BEYOND_CPU, run_ranks

CFG = GPTConfig(vocab=64, seq_len=16, layers=2, heads=4, hidden=32)


def _layout(rank, world_size, dp, tp, pp):
    mesh = Mesh(dp=dp, tp=tp, pp=pp)
    embedding = ops.group_ranks(mesh.embedding_group) if mesh.embedding_group else None
    return (mesh.coords, ops.group_ranks(mesh.tp_group), ops.group_ranks(mesh.dp_group),
            ops.group_ranks(mesh.pp_group), embedding, mesh.prev_stage_rank,
            mesh.next_stage_rank)


def test_tp_ranks_are_consecutive_then_dp_then_pp():
    layout = run_ranks(_layout, 8, 2, 2, 2)
    coords, tp, dp, pp, embedding, prev, nxt = layout[5]
    assert (coords.dp, coords.tp, coords.pp) == (0, 1, 1)
    assert tp == (4, 5) and dp == (5, 7) and pp == (1, 5) and embedding == (1, 5)
    assert prev == 1 and nxt is None
    for rank, (coords, tp, dp, pp, *_) in enumerate(layout):
        assert rank in tp and rank in dp and rank in pp
        assert tp == tuple(range(tp[0], tp[0] + 2))  # consecutive: inside one node


def test_a_mesh_that_does_not_match_the_world_is_a_clear_error():
    with pytest.raises(Exception, match="dp x tp x pp = 2 x 2 x 1 = 4 does not match the "
                                        "world size 2"):
        run_ranks(_layout, 2, 2, 2, 1)
    with pytest.raises(Exception, match="tp must be a positive int, got 0"):
        run_ranks(_layout, 2, 2, 0, 1)


@pytest.mark.parametrize("dp, tp, pp", [(2, 2, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2)])
def test_3d_training_equals_one_process(dp, tp, pp):
    reference = train_reference(CFG, dp, steps=3)
    for result in run_ranks(train_3d, dp * tp * pp, dp, tp, pp, CFG, 3):
        assert result["state"]  # every rank owns part of the model
        for name, value in result["state"].items():
            assert (value - reference["state"][name].detach()).abs().max() <= 1e-5, name
    stages = {r["coords"].pp for r in run_ranks(train_3d, dp * tp * pp, dp, tp, pp, CFG, 1)}
    assert stages == set(range(pp))


@pytest.mark.parametrize("device", BEYOND_CPU)
@pytest.mark.parametrize("dp, tp, pp", [(1, 1, 1), (1, 2, 2), (2, 1, 2)])
def test_3d_training_equals_one_process_on_each_device(device, dp, tp, pp):
    reference = train_reference(CFG, dp, steps=2)
    on = "cuda" if device == "cuda" else "cpu"
    for result in run_ranks(train_3d, dp * tp * pp, dp, tp, pp, CFG, 2, 2, 2, 0.5, "1f1b", 0,
                            on, device=device):
        for name, value in result["state"].items():
            assert (value - reference["state"][name].detach()).abs().max() <= 1e-5, name


def test_gpipe_schedule_gives_the_same_model():
    reference = train_reference(CFG, 1, steps=2)
    for result in run_ranks(train_3d, 2, 1, 1, 2, CFG, 2, 2, 2, 0.5, "gpipe"):
        for name, value in result["state"].items():
            assert (value - reference["state"][name].detach()).abs().max() <= 1e-5, name


def test_more_stages_than_blocks_is_a_clear_error():
    with pytest.raises(Exception, match="pp=4 pipeline stages need at least 4 transformer "
                                        "blocks, the model has 2"):
        run_ranks(train_3d, 4, 1, 1, 4, CFG, 1)


@pytest.mark.parametrize("dp, tp, pp", [(2, 2, 1), (2, 1, 2), (1, 2, 2)])
def test_traffic_goes_only_through_the_groups_that_exist(dp, tp, pp):
    for result in run_ranks(train_3d, dp * tp * pp, dp, tp, pp, CFG, 1):
        traffic = result["traffic_per_step"]
        assert (traffic["tp"] > 0) == (tp > 1)
        assert (traffic["dp"] > 0) == (dp > 1)
        assert (traffic["pp"] > 0) == (pp > 1)
        assert (traffic["embedding"] > 0) == (pp > 1)
        assert traffic.get("other", 0) == 0


def test_zero2_in_a_pipeline_sums_the_tied_embedding_over_its_two_stages():
    """At ZeRO-2 the embedding's gradient is reduce-scattered inside backward, cut at other
    places on the first and on the last stage; it used to crash (no .grad to sum). Now the
    run equals ZeRO-1's, and the extra bytes are the formula's."""
    from engine.launch import launch
    from engine.train.cli import TrainConfig
    from engine.train.run import train_on_rank

    runs = {zero: launch(train_on_rank, 4, TrainConfig(dp=2, pp=2, zero=zero, steps=2),
                         backend="gloo", timeout=60, quiet=True) for zero in (1, 2)}
    for one, two in zip(runs[1], runs[2], strict=True):
        assert two["engine"]["run_losses"] == pytest.approx(one["engine"]["run_losses"],
                                                            rel=1e-6)
        assert two["engine"]["traffic"]["dp"] == two["engine"]["formulas"]["dp"].bytes
