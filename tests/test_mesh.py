"""engine.topology.Mesh with every named dimension: dp x cp x tp x pp, ep borrowed from dp x cp.

The rank sets equal ``init_device_mesh``'s with the same names; the 3D numbering (cp = ep = 1)
is unchanged; the gradient groups are the ones the parallelisms need."""

from __future__ import annotations

import pytest

from engine.comm import ops
from engine.topology import Mesh, check_mesh
from tests.helpers import run_ranks

GROUPS = ("dp", "cp", "tp", "pp", "dp_cp", "ep", "expert_dp")


def _groups(rank, world_size, dp, cp, tp, pp, ep):
    mesh = Mesh(dp=dp, cp=cp, tp=tp, pp=pp, ep=ep)
    return {"coords": mesh.coords, **{g: ops.group_ranks(getattr(mesh, f"{g}_group"))
                                      for g in GROUPS}}


def _device_mesh(rank, world_size, dp, cp, tp, pp):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
    sets = {name: tuple(dist.get_process_group_ranks(mesh[name].get_group()))
            for name in ("pp", "dp", "cp", "tp")}
    flat = mesh["dp", "cp"]._flatten("dp_cp")
    sets["dp_cp"] = tuple(dist.get_process_group_ranks(flat.get_group()))
    return sets


@pytest.mark.parametrize("dp, cp, tp, pp", [(2, 2, 2, 1), (2, 1, 2, 2), (1, 2, 2, 2)])
def test_every_group_equals_init_device_mesh(dp, cp, tp, pp):
    world = dp * cp * tp * pp
    ours = run_ranks(_groups, world, dp, cp, tp, pp, 1)
    theirs = run_ranks(_device_mesh, world, dp, cp, tp, pp)
    for rank, (mine, torch_sets) in enumerate(zip(ours, theirs, strict=True)):
        for name, ranks in torch_sets.items():
            assert tuple(sorted(mine[name])) == tuple(sorted(ranks)), (rank, name)


def test_cp_sits_between_tp_and_dp():
    layout = run_ranks(_groups, 8, 2, 2, 2, 1, 1)
    five = layout[5]  # ((0 * 2 + 1) * 2 + 0) * 2 + 1
    assert (five["coords"].dp, five["coords"].cp, five["coords"].tp) == (1, 0, 1)
    assert five["tp"] == (4, 5) and five["cp"] == (5, 7) and five["dp"] == (1, 5)
    assert five["dp_cp"] == (1, 3, 5, 7)


def test_3d_numbering_is_unchanged_without_cp():
    layout = run_ranks(_groups, 8, 2, 1, 2, 2, 1)
    five = layout[5]  # pp 1, dp 0, tp 1: 1 * 4 + 0 * 2 + 1
    assert (five["coords"].dp, five["coords"].tp, five["coords"].pp) == (0, 1, 1)
    assert five["tp"] == (4, 5) and five["dp"] == (5, 7) and five["pp"] == (1, 5)
    assert five["dp_cp"] == five["dp"] and five["cp"] == (5,)
    assert repr(five["coords"]) == "Coordinates(dp=0, tp=1, pp=1)"


def test_experts_borrow_the_dp_x_cp_ranks():
    layout = run_ranks(_groups, 8, 2, 2, 2, 1, 2)  # dp 2, cp 2, tp 2, ep 2
    for rank, groups in enumerate(layout):
        assert set(groups["ep"]) <= set(groups["dp_cp"])
        assert set(groups["expert_dp"]) <= set(groups["dp_cp"])
        assert len(groups["ep"]) == 2 and len(groups["expert_dp"]) == 2
        assert set(groups["ep"]) & set(groups["expert_dp"]) == {rank}
    assert layout[1]["ep"] == (1, 3) and layout[1]["expert_dp"] == (1, 5)
    assert layout[1]["coords"].ep == 0 and layout[3]["coords"].ep == 1


def test_expert_groups_are_expert_mesh_s_without_cp_and_tp():
    layout = run_ranks(_groups, 4, 4, 1, 1, 1, 2)
    assert [g["ep"] for g in layout] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [g["expert_dp"] for g in layout] == [(0, 2), (1, 3), (0, 2), (1, 3)]


def test_bad_degrees_are_refused_naming_the_value():
    with pytest.raises(ValueError, match=r"dp x cp x tp x pp = 2 x 2 x 1 x 1 = 4 does not "
                                         r"match the world size 8"):
        check_mesh(8, dp=2, cp=2)
    with pytest.raises(ValueError, match=r"ep = 3 must divide dp x cp = 2 x 2 = 4"):
        check_mesh(4, dp=2, cp=2, ep=3)
    with pytest.raises(ValueError, match="cp must be a positive int, got 0"):
        check_mesh(4, dp=2, cp=0)
