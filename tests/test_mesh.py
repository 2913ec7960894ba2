"""engine.topology.Mesh with every named dimension: dp x cp x tp x pp, ep borrowed from dp x cp.

The rank sets equal ``init_device_mesh``'s with the same names, the sub-axes of ``Mesh.split``
(dp_replicate x dp_shard, cp_ring x cp_ulysses) too; the 3D numbering (cp = ep = 1) is
unchanged; the gradient groups are the ones the parallelisms need."""

from __future__ import annotations

import pytest

from engine.comm import ops
from engine.topology import DIMENSIONS, SUB_AXES, Mesh, check_mesh, split_rank_sets
from engine.zero.hsdp import hsdp_rank_sets
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


# -- sub-axes: Mesh.split, as DeviceMesh unflattens a dimension ---------------------------------

SPLITS = {  # world: (dimension, inner, the Mesh's degrees), each split nontrivially
    4: [("dp", 2, {"dp": 4}), ("cp", 2, {"cp": 4})],  # HSDP's and usp_groups' default meshes
    8: [("dp", 2, {"dp": 4, "tp": 2}), ("cp", 2, {"cp": 4, "pp": 2})],
}


def _splits(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    found = []
    for dim, inner, degrees in SPLITS[world_size]:
        mesh = Mesh(**degrees)
        groups = mesh.split(dim, inner=inner)
        cached = mesh.split(dim, inner=inner) == groups
        outer_name, inner_name = SUB_AXES[dim]
        sizes = {"pp": mesh.pp, "dp": mesh.dp, "cp": mesh.cp, "tp": mesh.tp,
                 outer_name: getattr(mesh, dim) // inner, inner_name: inner}
        names = tuple(n for d in DIMENSIONS for n in ((outer_name, inner_name) if d == dim
                                                      else (d,)))
        device_mesh = init_device_mesh("cpu", tuple(sizes[n] for n in names),
                                       mesh_dim_names=names)
        theirs = {n: tuple(dist.get_process_group_ranks(device_mesh[n].get_group()))
                  for n in (inner_name, outer_name)}
        ours = dict(zip((inner_name, outer_name), map(ops.group_ranks, groups)))
        found.append((ours, theirs, cached and _views(mesh, dim, inner) == groups))
    errors = []
    for dim, inner in (("cp", 3), ("ep", 2)):  # refused before any group is built
        with pytest.raises(ValueError) as refused:
            Mesh(dp=world_size).split(dim, inner=inner)
        errors.append(str(refused.value))
    return found, errors


def _views(mesh, dim, inner):
    """The groups HSDP and USP take from ``mesh`` (the mesh's own, cached: no new group)."""
    import torch

    from engine.compose.usp import mesh_usp_groups
    from engine.cp import usp_groups
    from engine.zero.hsdp import HybridShardedDataParallel

    if dim == "cp":
        assert usp_groups(inner, mesh) == mesh_usp_groups(mesh, inner)
        return usp_groups(inner, mesh)
    hsdp = HybridShardedDataParallel(torch.nn.Linear(4, 4), torch.optim.SGD, inner, stage=2,
                                     mesh=mesh, lr=0.1)
    assert hsdp.replicas == mesh.dp // inner
    return hsdp.shard_group, hsdp.replica_group


@pytest.mark.parametrize("world", [4, 8])
def test_split_axes_equal_init_device_mesh(world):
    layout = run_ranks(_splits, world)
    for rank, (found, _) in enumerate(layout):
        for ours, theirs, cached in found:
            assert ours == theirs, (rank, ours, theirs)
            assert cached, rank
    if world == 4:  # hsdp_rank_sets and the Ulysses groups of consecutive ranks, as before
        shards, replicas = hsdp_rank_sets(4, 2)
        for rank, (found, _) in enumerate(layout):
            (hsdp, _, _), (usp, _, _) = found
            assert hsdp["dp_shard"] == tuple(shards[rank // 2]), rank
            assert hsdp["dp_replicate"] == tuple(replicas[rank % 2]), rank
            assert (usp["cp_ulysses"], usp["cp_ring"]) == (hsdp["dp_shard"],
                                                          hsdp["dp_replicate"]), rank
    else:  # rank 5: dp 2 / tp 1 of dp4 x tp2; pp 1 / cp 1 of pp2 x cp4
        (hsdp, _, _), (usp, _, _) = layout[5][0]
        assert (hsdp["dp_shard"], hsdp["dp_replicate"]) == ((5, 7), (1, 5))
        assert (usp["cp_ulysses"], usp["cp_ring"]) == ((4, 5), (5, 7))
    assert layout[0][1] == ["inner (cp split) = 3 must divide cp = 1 (1 % 3 = 1)",
                            f"a split cuts one of the dimensions {DIMENSIONS}, got 'ep'"]


def test_split_rank_sets_cut_each_group_inner_fastest():
    assert split_rank_sets([[0, 2, 4, 6], [1, 3, 5, 7]], 2) == (
        [[0, 2], [4, 6], [1, 3], [5, 7]], [[0, 4], [2, 6], [1, 5], [3, 7]])
    with pytest.raises(ValueError, match=r"inner = 3 must divide the size of the dimension it "
                                         r"splits = 4"):
        split_rank_sets([[0, 1, 2, 3]], 3)
