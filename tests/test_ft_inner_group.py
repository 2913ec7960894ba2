"""A replica group of two ranks whose ranks fail a round at different collectives: local rank
1's cross-replica all-reduce fails (a flaky link, injected) while local rank 0's succeeds and
goes on to the group's all-gather, which then times out. The round is retried; the group's
own Gloo group must be rebuilt for the retry (engine.ft.replica._inner_group): kept, its two
ranks would no longer agree on which collective comes next (one spent a collective the other
did not), and every later round would fail or mix an all-reduce with an all-gather."""

from __future__ import annotations

import datetime
import io
import multiprocessing

import pytest
import torch
import torch.distributed as dist

from engine.ft import reference_run
from engine.ft.group import QuorumGroup
from engine.ft.harness import store_in_a_process, warm_up
from engine.ft.replica import FaultTolerantReplica
from tests.helpers import descendants
from tests.test_ft import _loss, _model, _optimizer

STEPS, FLAKY_CALL = 4, 2  # local rank 1's cross all-reduce fails at step 1, attempt 0


def _flaky_average(original):
    calls = {"n": 0}

    def average(self, tensor):
        if self.tag == "l1":
            calls["n"] += 1
            if calls["n"] == FLAKY_CALL:
                raise RuntimeError("Connection reset by peer (injected)")
        return original(self, tensor)
    return average


def _rank(port: int, local: int, out) -> None:
    QuorumGroup.average = _flaky_average(QuorumGroup.average)  # this forked process only
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=20))
    torch.set_num_threads(1)
    model = _model()
    optimizer = _optimizer(model)
    ft = FaultTolerantReplica(store, 0, 1, model, optimizer, deadline_s=1.0, timeout_s=1.5,
                              local_rank=local, group_size=2)
    while ft.completed < STEPS:
        ft.train_step(lambda step: _loss(model, step, local))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    out.put((local, buffer.getvalue(), [(s, m, a) for s, m, _, a in ft.log], ft.inner_builds))


@pytest.mark.timeout(60)
def test_a_round_failed_at_different_collectives_is_retried_on_a_new_inner_group():
    warm_up(_model, _optimizer, _loss)  # the lazy imports done once, not in each rank
    context = multiprocessing.get_context("fork")
    # the store served by a process of its own, not a thread of this one, which forks the ranks
    with store_in_a_process(20, context=context) as store:
        out = context.Queue()
        procs = [context.Process(target=_rank, args=(store.port, local, out), daemon=True)
                 for local in range(2)]
        try:
            for p in procs:
                p.start()
            results = dict((r[0], r[1:]) for r in (out.get(timeout=45) for _ in procs))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=5)
    assert not descendants()  # the ranks and the store's process
    (state0, log0, builds0), (state1, log1, builds1) = results[0], results[1]
    assert log0 == log1
    assert [(s, a) for s, _, a in log0] == [(0, 0), (1, 1), (2, 0), (3, 0)]  # step 1 retried
    assert builds0 == builds1 == 2  # the first round's group, and the retry's
    final0 = torch.load(io.BytesIO(state0), weights_only=True)
    final1 = torch.load(io.BytesIO(state1), weights_only=True)
    want = reference_run(_model, _optimizer, _loss, [(s, m) for s, m, _ in log0], group_size=2)
    for name, t in final0.items():
        assert torch.equal(t, final1[name]), name
        assert (t - want[name]).abs().max().item() < 1e-6, name
