"""The pipeline's point-to-point traffic cannot deadlock on NCCL: every message goes through
``batch_isend_irecv`` in batches that match round by round (replayed under NCCL's strictest
behaviour), no host sync per message, and ``nccl_rules`` refuses the pattern that hangs (a
blocking receive behind an unbatched send to the same peer)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from engine.comm import ops
from engine.observe.nccl_rules import nccl_rules
from engine.labs.pipeline import schedule_by_name
from engine.pp.link import plan_rounds, rendezvous_deadlock
from tests import test_pp
from tests.helpers import run_ranks
from tests.test_pp import _train

SCHEDULES = ["1f1b", "interleaved", "zb_h1", "zb_v", "dualpipe_v"]


def _counted_run(rank, p, kind, m):
    """One step of ``kind`` under ``nccl_rules``, every point-to-point call of ``engine.comm.ops``
    counted: (calls per op, sends and receives posted in batches, the link's log, host syncs)."""
    calls = {name: 0 for name in ("send", "recv", "isend", "irecv", "batch_isend_irecv")}
    in_batches = {"send": 0, "recv": 0}
    originals = {name: getattr(ops, name) for name in calls}

    def counting(name):
        def call(*args, **kwargs):
            calls[name] += 1
            if name == "batch_isend_irecv":
                for op in args[0]:
                    in_batches["send" if op.op is torch.distributed.isend else "recv"] += 1
            return originals[name](*args, **kwargs)
        return call

    syncs = {"tolist": 0, "item": 0}  # host syncs inside run_pipeline
    tolist, item, run_pipeline = torch.Tensor.tolist, torch.Tensor.item, test_pp.run_pipeline

    inside = []  # nccl_rules' torch function mode calls the method again: count it once

    def counted(name, method):
        def call(self):
            syncs[name] += not inside
            inside.append(name)
            try:
                return method(self)
            finally:
                inside.pop()
        return call

    def counted_run(*args, **kwargs):
        torch.Tensor.tolist, torch.Tensor.item = counted("tolist", tolist), counted("item", item)
        try:
            return run_pipeline(*args, **kwargs)
        finally:
            torch.Tensor.tolist, torch.Tensor.item = tolist, item

    for name in calls:
        setattr(ops, name, counting(name))
    test_pp.run_pipeline = counted_run
    try:
        _, _, run = _train(rank, p, kind, m, 2, 1)
    finally:
        for name, original in originals.items():
            setattr(ops, name, original)
        test_pp.run_pipeline = run_pipeline
    return calls, in_batches, run.p2p_log, syncs


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("p", [2, 4])
def test_every_pipeline_send_is_posted_in_a_batch_and_the_batches_cannot_deadlock(kind, p):
    m = 2 * p
    results = run_ranks(_counted_run, p, kind, m)
    schedule = schedule_by_name(kind, p, m, 2)
    program = plan_rounds(schedule.actions, schedule.placement)
    assert program == schedule.rounds  # what the runs followed
    for stage, (calls, in_batches, log, syncs) in enumerate(results):
        assert calls["send"] == calls["recv"] == calls["isend"] == calls["irecv"] == 0
        posts = [ops_ for what, ops_ in log if what == "post"]
        assert calls["batch_isend_irecv"] == len(posts) > 0
        assert in_batches["send"] == sum(op == "send" for ops_ in posts for op, *_ in ops_)
        assert in_batches["recv"] == sum(op == "recv" for ops_ in posts for op, *_ in ops_)
        # a batch holds sends without a receive only in a round where no message comes to
        # this rank (the first stage's warm-up, the last sends): pairing such a send with a
        # later receive would queue the rank's next batches behind it on NCCL's stream
        lone = [b for b in posts if {op for op, *_ in b} == {"send"}]
        assert len(lone) == sum(1 for item in program[stage]
                                if item[0] == "batch" and item[1] and not item[2])
        # one shape header read per virtual stage that sends to this rank, no .item() at all
        headers = sum(part == "header" and op == "recv" for b in posts for op, _, _, part in b)
        assert syncs["tolist"] == headers and syncs["item"] == 0
    assert rendezvous_deadlock({s: log for s, (_, _, log, _) in enumerate(results)}) is None


def test_one_f_one_b_pairs_as_megatron_does():
    """2 stages, 4 micro-batches: after its first forward, stage 0 sends each activation with
    the receive of a gradient (``send_forward_recv_backward``), stage 1 each gradient with the
    receive of the next activation (``send_backward_recv_forward``)."""
    schedule = schedule_by_name("1f1b", 2, 4, 1)
    program = plan_rounds(schedule.actions, schedule.placement)

    def batches(stage):
        return [([m[0][0] + str(m[0][1]) for m in sends], [m[0][0] + str(m[0][1])
                                                            for m in receives])
                for kind, *rest in program[stage] if kind == "batch"
                for sends, receives in [rest]]

    assert batches(0) == [(["act0"], []), (["act1"], ["grad0"]), (["act2"], ["grad1"]),
                          (["act3"], ["grad2"]), ([], ["grad3"])]
    assert batches(1) == [([], ["act0"]), (["grad0"], ["act1"]), (["grad1"], ["act2"]),
                          (["grad2"], ["act3"]), (["grad3"], [])]


def test_the_replay_finds_a_deadlock():
    """Both ranks send first, each in a batch of its own, and receive in the next: on NCCL
    neither send completes."""
    act, grad = ("act", 0, 0), ("grad", 0, 1)
    logs = {0: [("post", [("send", 1, act, "data")]), ("wait", 0),
                ("post", [("recv", 1, grad, "data")]), ("wait", 1)],
            1: [("post", [("send", 0, grad, "data")]), ("wait", 0),
                ("post", [("recv", 0, act, "data")]), ("wait", 1)]}
    assert "stuck" in rendezvous_deadlock(logs)
    logs = {0: [("post", [("send", 1, act, "data"), ("recv", 1, grad, "data")]), ("wait", 0)],
            1: [("post", [("send", 0, grad, "data"), ("recv", 0, act, "data")]), ("wait", 0)]}
    assert rendezvous_deadlock(logs) is None


def _send_then_receive(rank, world_size, how):
    peer = 1 - rank
    mine, theirs = torch.full((4,), float(rank)), torch.empty(4)
    with nccl_rules("cpu"):
        if how == "unbatched":  # what pp/link.py did: isend, then a blocking recv
            work = ops.isend(mine, peer)
            ops.recv(theirs, peer)
            work.wait()
        elif how == "waited":
            if rank == 0:
                ops.isend(mine, peer).wait()
                ops.recv(theirs, peer)
            else:
                ops.recv(theirs, peer)
                ops.isend(mine, peer).wait()
        else:
            for work in ops.batch_isend_irecv([ops.send_op(mine, peer),
                                               ops.recv_op(theirs, peer)]):
                work.wait()
    return theirs.tolist()


def test_nccl_rules_refuse_a_blocking_receive_behind_an_unbatched_send():
    with pytest.raises(Exception, match="ops.recv from rank [01], a blocking receive, at .*"
                                        "while an unbatched send to rank [01] is still "
                                        "pending .*ops.batch_isend_irecv"):
        run_ranks(_send_then_receive, 2, "unbatched")
    for how in ("waited", "batched"):
        assert run_ranks(_send_then_receive, 2, how) == [[1.0] * 4, [0.0] * 4]


def test_a_micro_batch_of_another_shape_is_a_clear_error():
    def run(rank, world_size):
        from engine.pp import one_f_one_b, run_pipeline

        xs = [torch.ones(2, 4), torch.ones(3, 4)]
        with nccl_rules("cpu"):
            run_pipeline([nn.Linear(4, 4)], one_f_one_b(2, 2), xs, xs, stage=rank)

    with pytest.raises(Exception, match=r"virtual stage 0 sends activations of shape \(3, 4\) "
                                        r"for micro-batch 1, but \(2, 4\) before"):
        run_ranks(run, 2)


def _connects(rank, world_size):
    from engine.pp import link

    reduced = []
    all_reduce, get_backend = ops.all_reduce, dist.get_backend
    ops.all_reduce = lambda tensor, *a, **k: reduced.append(tensor.numel())
    dist.get_backend = lambda group=None: "nccl"  # Gloo ranks that read as NCCL
    try:
        link.connect(None, torch.device("cpu"))
        link.connect(None, torch.device("cpu"))  # once per group and process
    finally:
        ops.all_reduce, dist.get_backend = all_reduce, get_backend
        link.CONNECTED_GROUPS.clear()
    return reduced


def test_on_nccl_every_rank_of_the_group_runs_a_collective_before_the_first_batch():
    """PyTorch's batch_isend_irecv on NCCL needs the whole group in the group's first
    collective call; a pipeline batch involves two ranks."""
    assert run_ranks(_connects, 2) == [[1], [1]]


def _dry_log(schedule, stage):
    """The link's log for ``stage`` of the built ``schedule``, its batches posted to nothing
    (a header reads as a 0-dimensional shape): what the runtime would post, without ranks."""
    from unittest import mock

    from engine.pp import link as link_module
    from engine.pp.actions import rank_of, virtual_stages

    p, v, placement = schedule.p, schedule.v, schedule.placement
    last, mine = p * v - 1, virtual_stages(stage, p, v, placement)
    with mock.patch.object(ops, "batch_isend_irecv", lambda batch: []), \
            mock.patch.object(ops, "send_op", lambda *a: None), \
            mock.patch.object(ops, "recv_op", lambda *a: None), \
            mock.patch.object(link_module, "connect", lambda *a: None):
        link = link_module.Link(schedule, stage, list(range(p)), None, torch.float32,
                                torch.device("cpu"))
        for kind, mb, c in link.actions():
            vs = mine[c]
            if kind == "F" and vs != last:
                link.send(torch.zeros(2, 3), ("act", mb, vs), rank_of(vs + 1, p, placement))
            if kind == "B" and vs != 0:
                link.send(torch.zeros(2, 3), ("grad", mb, vs), rank_of(vs - 1, p, placement))
    return link.log


@pytest.mark.parametrize("kind", ["gpipe", *SCHEDULES])
def test_every_schedule_s_batches_replay_without_deadlock_on_many_shapes(kind):
    tried = 0
    for p in (1, 2, 3, 4, 8):
        for m in range(1, 3 * p + 1):
            for v in (2, 3):
                try:
                    schedule = schedule_by_name(kind, p, m, v)
                except ValueError:  # a size the schedule does not take
                    continue
                logs = {s: _dry_log(schedule, s) for s in range(p)}
                assert rendezvous_deadlock(logs) is None, (kind, p, m, v)
                tried += 1
    assert tried >= 10
