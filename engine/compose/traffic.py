"""Bytes on the wire per kind of group (dp, cp, ep, tp, pp) of a composed run, and the formula
for the data-parallel gradient traffic where one is simple.

A :class:`engine.comm.CommMeter` opened with ``count="wire"`` counts every message this rank
sends, each event naming the ranks of its group. :func:`bytes_by_kind` names the group by the
:class:`engine.topology.Mesh` dimension it is, resolving groups that hold the same ranks (ep is
borrowed from dp x cp) by the operation: an all-to-all of an MoE model is expert parallelism,
another (Ulysses) context parallelism; a point-to-point message on the pipeline group is pp,
on the context group cp (ring attention). Gradient reductions over ``dp_cp_group`` count as
dp, over ``expert_dp_group`` as ep, the tied embedding's over ``embedding_group`` as pp.

:func:`dp_formula` is what the data-parallel wrapper must send per rank, by the ring
algorithm (:func:`engine.theory.ring_all_reduce_bytes`, A: an all-reduce of every parameter
byte this rank holds; a reduce-scatter or an all-gather is A / 2), plus the 4-byte loss, per
step of ``m`` micro-batches: DDP (gradients kept local but for the last micro-batch) and
ZeRO-1 one A; ZeRO-2 a reduce-scatter per micro-batch and one all-gather, (m + 1) A / 2;
ZeRO-3 per micro-batch two all-gathers (forward, backward) and a reduce-scatter, 1.5 m A,
less one all-gather of its root unit per micro-batch (:mod:`engine.zero.stage3`: the root is
gathered when the forward starts and kept until the backward ends).
``None`` where the count depends on more than the parameter bytes (a pipeline or experts).
"""

from __future__ import annotations

from engine.comm import ops
from engine.theory import ring_all_reduce_bytes
from engine.topology import Mesh

KINDS = ("dp", "cp", "ep", "tp", "pp")
P2P = ("send", "recv", "isend", "irecv", "batch_isend_irecv")


def group_kinds(mesh: Mesh) -> list[tuple[tuple[int, ...], str]]:
    """``(ranks, kind)`` of every group of ``mesh`` this rank is in, most specific first."""
    named = [("tp", mesh.tp_group), ("dp", mesh.dp_cp_group), ("dp", mesh.dp_group),
             ("cp", mesh.cp_group), ("ep", mesh.expert_dp_group), ("ep", mesh.ep_group),
             ("pp", mesh.pp_group), ("pp", mesh.embedding_group)]
    return [(tuple(ops.group_ranks(g)), kind) for kind, g in named if g is not None]


def kind_of(event, mesh: Mesh, moe: bool) -> str:
    """The dimension ``event`` (a :class:`engine.comm.CommEvent`) travelled on."""
    ranks = tuple(event.group)
    if event.op == "all_to_all":
        return "ep" if moe and ranks == tuple(ops.group_ranks(mesh.ep_group)) else "cp"
    if event.op in P2P:
        return "pp" if mesh.pp > 1 and ranks == tuple(ops.group_ranks(mesh.pp_group)) \
            else "cp"
    for group, kind in group_kinds(mesh):
        if ranks == group:
            return kind
    raise ValueError(f"{event.op} on ranks {ranks} is on no group of {mesh!r}")


def bytes_by_kind(events, mesh: Mesh, moe: bool) -> dict[str, int]:
    """Bytes this rank sent, per kind of group (module docstring)."""
    sent = dict.fromkeys(KINDS, 0)
    for event in events:
        if event.bytes_sent:
            sent[kind_of(event, mesh, moe)] += event.bytes_sent
    return sent


def dp_formula(param_bytes: int, replicas: int, zero: int, steps: int, micro_batches: int,
               pp: int = 1, ep: int = 1, root_bytes: int = 0) -> float | None:
    """Bytes one rank sends over dp x cp in ``steps`` steps (module docstring);
    ``root_bytes``: ZeRO-3's root unit, padded."""
    if pp > 1 or ep > 1:
        return None
    if replicas == 1:
        return 0.0
    all_reduces = {0: 1.0, 1: 1.0, 2: (micro_batches + 1) / 2, 3: 1.5 * micro_batches}[zero]
    per_step = ring_all_reduce_bytes(param_bytes, replicas) * all_reduces
    if zero == 3:
        per_step -= micro_batches * ring_all_reduce_bytes(root_bytes, replicas) / 2
    return steps * (per_step + ring_all_reduce_bytes(4, replicas))
