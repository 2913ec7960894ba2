"""engine.steps.traffic_by_group (the older paths' bookkeeper) reads an event's purpose first,
as engine.compose.traffic.kind_of does (tests/test_traffic_purpose.py): a Ulysses all-to-all
tagged ``cp`` is context-parallel traffic even where the strategy names an ``ep`` group (by
its operation alone it was counted as ep), and all-gather attention's all-gathers tagged
``cp`` are not gradient traffic of the group holding the same ranks. Untagged events keep the
rules by operation and ranks. No strategy that counts with traffic_by_group today (PyTorch's
wrappers, benchmarks/zero3_trainer.py) runs attention over cp or an MoE dispatch, so this
changes none of their numbers: the events here are built by hand, the bookkeeping is pure."""

from __future__ import annotations

from types import SimpleNamespace

from engine.comm import CommEvent
from engine.steps import purpose_names_kind, traffic_by_group


def _mesh(**degrees):
    """A mesh whose groups are all one rank (``None``: nothing to look up by ranks)."""
    sizes = dict(dp=1, cp=1, ep=1, tp=1, pp=1) | degrees
    return SimpleNamespace(**sizes, tp_group=None, dp_group=None, embedding_group=None)


def _event(op: str, sent: int, purpose: str = "") -> CommEvent:
    return CommEvent(op=op, group=(0, 1), payload_bytes=sent, bytes_sent=sent,
                     bytes_received=sent, measured=True, algorithm="pairwise", start=0.0,
                     purpose=purpose)


def test_a_said_purpose_names_the_bytes_before_the_operation_and_the_ranks():
    events = [_event("all_to_all", 64, "cp"),  # Ulysses: counted as ep before
              _event("all_gather", 32, "cp"),  # all-gather attention
              _event("all_to_all", 16, "ep"),  # the MoE dispatch
              _event("all_to_all", 8),  # untagged: ep, as there is an ep group
              _event("send", 4),  # untagged point to point: the pipeline's
              _event("all_reduce", 2)]  # untagged, on no group it knows
    traffic = traffic_by_group(events, _mesh(cp=2), more={"ep": None})
    assert traffic == {"dp": 0, "tp": 0, "pp": 4, "embedding": 0, "cp": 96, "ep": 24,
                       "other": 2}


def test_a_purpose_names_a_kind_only_where_there_is_one():
    mesh = _mesh(cp=2)
    assert purpose_names_kind("cp", {}, mesh)
    assert not purpose_names_kind("cp", {}, _mesh())  # cp = 1: no cp traffic to name
    assert purpose_names_kind("ep", {"ep": None}, mesh)  # the strategy's own ep group
    assert not purpose_names_kind("ep", {}, mesh)
    assert not purpose_names_kind("", {"ep": None}, mesh)  # not said
    assert not purpose_names_kind("seconds", {}, mesh)  # not a dimension
    # untagged, a cp all-to-all under an ep group is counted as ep: the rule by operation
    assert traffic_by_group([_event("all_to_all", 64)], mesh, {"ep": None})["ep"] == 64
