"""Bytes on the wire per kind of group (dp, cp, ep, tp, pp) of a composed run: the one
bookkeeper of composed bytes, for ``python -m engine parity`` and ``engine train`` alike.

A :class:`engine.observe.meter.CommMeter` opened with ``count="wire"`` counts every message this rank
sends, each event naming the ranks of its group and, where the layer that issued it said so,
its purpose (:class:`engine.observe.meter.comm_purpose`, set at the call, forward and backward): ring
attention's, all-gather attention's and Ulysses' (USP's) traffic is tagged ``cp``, the MoE
dispatch and combine all-to-alls (and their token counts) ``ep``. :func:`kind_of` takes that
tag first. The ranks cannot tell these apart, since :class:`engine.topology.Mesh` reuses one
group wherever two dimensions hold the same ranks: with dp = 1 the cp group *is* dp x cp (all-
gather attention's all-gathers and reduce-scatters look like gradient reductions), and where
ep = cp an MoE model's Ulysses all-to-alls look like the experts'.

An untagged event is named by its ranks and operation: an all-to-all on the ep group of an MoE
model is expert parallelism, another context parallelism; a point-to-point message on the
pipeline group is pp, on another group cp; gradient reductions over ``dp_cp_group`` count as
dp, over ``expert_dp_group`` as ep, the tied embedding's over ``embedding_group`` as pp.
The formulas beside the counts are :mod:`engine.compose.formulas`'.
"""

from __future__ import annotations

from engine.comm import ops
from engine.compose.formulas import dp_formula  # re-exported: its home before
from engine.topology import Mesh

KINDS = ("dp", "cp", "ep", "tp", "pp")
__all__ = ["KINDS", "P2P", "group_kinds", "kind_of", "on_embedding_group", "tagged",
           "bytes_by_kind", "dp_formula",
           "gradient_group_name", "report_names", "report_traffic"]
P2P = ("send", "recv", "isend", "irecv", "batch_isend_irecv")


def group_kinds(mesh: Mesh) -> list[tuple[tuple[int, ...], str]]:
    """``(ranks, kind)`` of every group of ``mesh`` a composed run issues collectives on,
    most specific first. Not ``mesh.dp_group``: the composed engine reduces over dp x cp,
    never over dp alone, and with cp > 1 the dp ranks can be exactly the ranks of
    ``expert_dp_group`` (dp2 x cp2 x ep2: ep takes the two cp ranks, the experts' replicas are
    the two dp ranks), whose gradients would then count as dp. With ep > 1 the expert-dp
    ranks are a strict part of dp x cp and never a cp group, so they name one kind."""
    named = [("tp", mesh.tp_group), ("dp", mesh.dp_cp_group), ("cp", mesh.cp_group),
             ("ep", mesh.expert_dp_group), ("ep", mesh.ep_group),
             ("pp", mesh.pp_group), ("pp", mesh.embedding_group)]
    return [(tuple(ops.group_ranks(g)), kind) for kind, g in named if g is not None]


def kind_of(event, mesh: Mesh, moe: bool, embedding: bool = False) -> str:
    """The dimension ``event`` (a :class:`engine.observe.meter.CommEvent`) travelled on: its
    ``purpose`` when that names a dimension of more than one rank of ``mesh``, else found
    from its ranks and operation (module docstring). ``embedding=True``: the tied embedding's
    gradient sum (a collective on ``mesh.embedding_group``, not the loss's broadcast) is a
    kind of its own, ``embedding``, as chapter 07 shows it; else it counts as pp."""
    if embedding and on_embedding_group(event, mesh):
        return "embedding"
    if tagged(event.purpose, mesh):
        return event.purpose
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


def on_embedding_group(event, mesh: Mesh) -> bool:
    """Whether ``event`` is a collective (not the loss's broadcast) on the embedding group."""
    return (mesh.embedding_group is not None and event.op not in P2P
            and event.op != "broadcast"
            and tuple(event.group) == tuple(ops.group_ranks(mesh.embedding_group)))


def tagged(purpose: str, mesh: Mesh) -> bool:
    """Whether ``purpose`` names a dimension of ``mesh`` with more than one rank (dp: of dp x
    cp, the group the composed engine reduces gradients over)."""
    if purpose not in KINDS:
        return False
    return (mesh.dp_cp_size if purpose == "dp" else getattr(mesh, purpose)) > 1


def bytes_by_kind(events, mesh: Mesh, moe: bool, embedding: bool = False) -> dict[str, int]:
    """Bytes this rank sent, per kind of group (module docstring; ``embedding``:
    :func:`kind_of`'s)."""
    sent = dict.fromkeys(KINDS + (("embedding",) if embedding else ()), 0)
    for event in events:
        if event.bytes_sent:
            sent[kind_of(event, mesh, moe, embedding)] += event.bytes_sent
    return sent


def gradient_group_name(mesh: Mesh) -> str:
    """How ``engine train``'s report names the group dense gradients are reduced over (dp x
    cp): ``dp`` or ``cp`` when the other is 1 (the same ranks)."""
    return "dp" if mesh.cp == 1 else "cp" if mesh.dp == 1 else "dp x cp"


def report_names(by_kind: dict, mesh: Mesh, add=lambda a, b: a + b) -> dict:
    """``by_kind`` (counted bytes or formulas, per kind) under ``engine train``'s names: the
    gradients' ``dp`` renamed :func:`gradient_group_name` (merged with ``cp`` by ``add``
    when dp = 1); kinds of one rank and ``None`` left out."""
    out = {}
    for kind, value in by_kind.items():
        if value is None or (kind != "dp" and getattr(mesh, kind) == 1):
            continue
        if kind == "dp":
            if mesh.dp_cp_size == 1:
                continue
            kind = gradient_group_name(mesh)
        out[kind] = add(out[kind], value) if kind in out else value
    return out


def report_traffic(events, mesh: Mesh, moe: bool) -> dict[str, int]:
    """:func:`bytes_by_kind` under ``engine train``'s names (:func:`report_names`), for the
    composed engine and PyTorch's wrappers alike (``moe``: an all-to-all over the ep group is
    the experts')."""
    return report_names(bytes_by_kind(events, mesh, moe), mesh)
