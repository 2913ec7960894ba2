"""Every composed byte named by the purpose it was sent for (engine.observe.meter.comm_purpose), not only
by the ranks of its group: where two dimensions of the mesh hold the same ranks, the ranks
cannot tell them apart (engine.compose.traffic). Bytes below: one step, summed over ranks.

* cp2 with all-gather attention: dp = 1, so the cp group *is* dp x cp; before the tag, its
  all-gathers and reduce-scatters (49,152 B) were counted as dp, the gradients', and the cp
  column read 0 against a formula of 49,152 B.
* MoE with Ulysses, ep = cp = 2: the Ulysses group is the ep group; before the tag, Ulysses'
  all-to-alls (49,152 B) were counted as ep; the same with USP's inner Ulysses groups.
* The tag reaches the collectives autograd issues in backward, on whatever thread runs it (CUDA
  runs backward on its own thread; here a Python thread stands in for it).
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from engine.compose.parity import Row, _p, run_row
from engine.compose.traffic import KINDS
from tests.helpers import run_ranks


def _assert_counted_equals_formula(result, present):
    for kind in KINDS:  # exact, summed over the ranks (tests/test_parity.py's rule)
        assert result.formulas[kind] is not None, (kind, result.formulas)
        assert result.sent[kind] == result.formulas[kind], (kind, result.sent, result.formulas)
        assert (result.sent[kind] > 0) == (kind in present), (kind, result.sent)
    assert result.holds, (result.loss_diff, result.param_diff)


def test_allgather_attention_with_dp_1_counts_as_cp_not_dp():
    result = run_row(Row(_p(cp=2, cp_method="allgather")), steps=1)
    _assert_counted_equals_formula(result, {"dp", "cp"})
    assert result.sent["dp"] == result.dp_formula  # the gradients' all-reduce alone


@pytest.mark.parametrize("plan", [_p(cp=2, ep=2, cp_method="ulysses"),
                                  _p(cp=4, ep=2, cp_method="usp:2x2")],
                         ids=["ulysses cp2 ep2", "usp 2x2 ep2"])
def test_moe_ulysses_on_the_ep_ranks_counts_as_cp_and_ep_apart(plan):
    """USP 2x2 with ep 2: the Ulysses groups (cp indices 0-1, 2-3) are the ep groups; before
    the tag, 49,152 B of its 98,304 B of cp counted as ep."""
    result = run_row(Row(plan, moe=True), steps=1)
    _assert_counted_equals_formula(result, {"dp", "cp", "ep"})


def _issue_and_backward_on_a_thread(mesh):
    """Ulysses attention and an MoE dispatch/combine on the same two ranks, forward here and
    backward on another thread, then an untagged all-reduce over dp x cp (the same ranks):
    ``[(phase, op, purpose, kind)]`` of every event this rank recorded."""
    from engine.observe.meter import CommMeter
    from engine.comm import ops
    from engine.compose.traffic import kind_of
    from engine.cp.ulysses import ulysses_attention
    from engine.moe.dispatch import combine, dispatch

    torch.manual_seed(mesh.rank)
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    rows = torch.randn(6, 8, requires_grad=True)
    expert = torch.tensor([0, 1, 1, 0, 1, 0])
    failures = []

    def backward(loss):
        try:
            loss.backward()
        except BaseException as error:  # noqa: BLE001 - re-raised on the rank's thread
            failures.append(error)

    with CommMeter(count="wire") as meter:
        out = ulysses_attention(q, k, v, group=mesh.cp_group, check=False)
        arrived, _, state = dispatch(rows, expert, 2, mesh.ep_group)
        loss = out.sum() + combine(arrived * 2, state).sum()
        forward = len(meter.events)
        worker = threading.Thread(target=backward, args=(loss,))
        worker.start()
        worker.join()
        if failures:
            raise failures[0]
        backward_end = len(meter.events)
        ops.all_reduce(torch.ones(2), group=mesh.dp_cp_group)
    phases = ["forward"] * forward + ["backward"] * (backward_end - forward) + ["after"]
    return [(phase, e.op, e.purpose, kind_of(e, mesh, moe=True))
            for phase, e in zip(phases, meter.events, strict=True)]


def _tags_in_backward(rank, world_size):
    import engine.comm.autograd
    from engine.observe.meter import current_purpose
    from engine.topology import Mesh

    mesh = Mesh(cp=2, ep=2)  # dp = 1: cp, ep and dp x cp are the same two ranks
    tagged = _issue_and_backward_on_a_thread(mesh)
    leaked = current_purpose()
    # the mutation: an autograd all-to-all that does not carry its forward's purpose into
    # backward (as a purpose set around loss.backward() on this thread would not reach
    # autograd's): the test below must see it
    carried = engine.comm.autograd.comm_purpose
    engine.comm.autograd.comm_purpose = lambda name: contextlib.nullcontext()
    try:
        untagged = _issue_and_backward_on_a_thread(mesh)
    finally:
        engine.comm.autograd.comm_purpose = carried
    return tagged, leaked, untagged


def test_the_purpose_reaches_collectives_issued_in_backward_on_another_thread():
    # forward: Ulysses' 2 all-to-alls, the dispatch's counts and rows, the combine's rows;
    # backward: the 2 rows' all-to-alls of dispatch and combine and Ulysses' 2; the events of
    # one rank, in the order issued (autograd's order among the backward ones)
    for tagged, leaked, untagged in run_ranks(_tags_in_backward, 2):
        assert leaked == ""  # nothing left behind on the rank's own thread
        assert [(p, op) for p, op, _, _ in tagged] == \
            [("forward", "all_to_all")] * 5 + [("backward", "all_to_all")] * 4 + \
            [("after", "all_reduce")], tagged
        forward, backward = tagged[:5], tagged[5:9]
        assert [purpose for _, _, purpose, _ in forward] == ["cp", "cp", "ep", "ep", "ep"]
        assert sorted(purpose for _, _, purpose, _ in backward) == ["cp", "cp", "ep", "ep"]
        assert all(purpose == kind for _, _, purpose, kind in tagged[:9]), tagged
        assert tagged[9][2:] == ("", "dp")  # untagged: named by its ranks, dp x cp
        # without the purpose carried into backward, the backward events are untagged and
        # Ulysses' all-to-alls on the ep ranks are named ep (the old count)
        assert [purpose for _, _, purpose, _ in untagged[5:9]] == [""] * 4, untagged
        assert [kind for _, _, _, kind in untagged[5:9]] == ["ep"] * 4, untagged


def test_a_purpose_belongs_to_its_thread_and_nests():
    """A gradient hook on autograd's thread must not take the purpose a forward on the main
    thread has set, and an inner purpose gives way to the outer one when it ends."""
    from engine.observe.meter import comm_purpose
    from engine.observe.meter import current_purpose

    seen = []
    with comm_purpose("cp"):
        worker = threading.Thread(target=lambda: seen.append(current_purpose()))
        worker.start()
        worker.join()
        with comm_purpose("ep"):
            seen.append(current_purpose())
        seen.append(current_purpose())
    seen.append(current_purpose())
    assert seen == ["", "ep", "cp", ""]
