"""Per-step fault tolerance (engine.ft): three replica groups of two ranks, one group
SIGKILLed mid-step; the survivors finish the next step without a restart, it rejoins with the
survivors' state bit for bit, and the run equals the algorithm recomputed in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import theory
from engine.ft import check_replica_groups, reference_run, run_with_failure
from engine.ft.state import pack_state, unpack_state
from engine.model.mlp import MLP
from engine.model.data import regression_data
from tests.helpers import descendants

SIZES = (8, 16, 8)
GROUP = 2  # ranks per replica group


def _model():
    return MLP(SIZES, seed=7)


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _loss(model, step, rank):
    x, y = regression_data(8, 8, 8, seed=1000 * step + rank)
    return nn.functional.mse_loss(model(x), y)


# How long the live replica groups wait for a quorum entry before leaving a group out: short
# enough to show the cost of a failure, long enough that a healthy rank of a 2-core CI machine
# running six ranks is never left out by a scheduling stall.
DEADLINE_S = 2.0


@pytest.mark.timeout(90)
def test_a_killed_replica_group_rejoins_and_the_run_equals_the_reference():
    steps, kill = 10, (2, 3)
    run = run_with_failure(_model, _optimizer, _loss, replicas=3, steps=steps, kill=kill,
                           restart_after=2, deadline_s=DEADLINE_S, timeout_s=5.0,
                           group_size=GROUP)
    assert not descendants(), "a replica process was left behind"
    victims = {f"{kill[0]}.{l}" for l in range(GROUP)}
    log = run.logs["0.0"]
    assert [s for s, *_ in log] == list(range(steps))
    for name, codes in run.exit_codes.items():
        if f"{name[0]}.{name[1]}" in victims:
            assert codes == [-9, 0]  # SIGKILL, then the restarted rank ends normally
        else:  # the survivors agree on every step's quorum, and never restarted
            assert codes == [0]
            assert [(s, m) for s, m, *_ in run.logs[f"{name[0]}.{name[1]}"]] == \
                [(s, m) for s, m, *_ in log]
    quorums = {s: m for s, m, *_ in log}
    survivors = tuple(r for r in range(3) if r != kill[0])
    assert quorums[kill[1]] == survivors  # step k: finished without the killed group
    assert quorums[kill[1] + 1] == survivors  # and step k + 1
    assert kill[1] + 1 < run.rejoined_step < steps  # rejoined later, from a live peer
    assert all(kill[0] in quorums[s] for s in range(run.rejoined_step, steps))
    assert run.recovery_bit_identical
    finals = list(run.finals.values())
    for other in finals[1:]:  # every rank ends with the same bits, optimizer state too
        for name, t in finals[0]["model"].items():
            assert torch.equal(t, other["model"][name]), name
        for i, s in finals[0]["optimizer"]["state"].items():
            for key, t in s.items():
                assert torch.equal(t, other["optimizer"]["state"][i][key]), (i, key)
    want = reference_run(_model, _optimizer, _loss, log, group_size=GROUP)
    worst = max((want[n] - t).abs().max().item() for n, t in finals[0]["model"].items())
    assert worst < 1e-6, worst
    # across replica groups each rank sends its half of the gradient: the HSDP cut
    numel = sum(p.numel() for p in _model().parameters())
    per_step = {len(m): round(theory.ring_all_reduce_bytes(numel / GROUP * 4, len(m)))
                for m in quorums.values()}  # each all-reduce rounded to whole bytes
    assert run.cross_bytes["0.1"] == sum(per_step[len(m)] for m in quorums.values())
    # Time is reported, never asserted (a loaded machine is slower, not wrong): the survivors
    # lose about DEADLINE_S at the failed step, waiting for the dead group's quorum entry.
    print(f"time lost at the failed step: {run.lost_seconds:.2f} s")


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="group_size .* = 4 must divide the world size = 6"):
        check_replica_groups(6, 4)
    other = MLP((8, 32, 8))
    with pytest.raises(ValueError, match="another model"):
        unpack_state(pack_state(_model(), _optimizer(_model()), 3), other, _optimizer(other))


def test_the_best_checkpoint_interval_is_youngs():
    from engine.ft.interval import best_interval, simulate_wall_time

    c, m = 60.0, 4 * 3600.0  # a one-minute checkpoint, a failure every four hours
    young = theory.young_checkpoint_interval(c, m)  # 1,315 s
    grid = [young * f for f in (0.25, 0.4, 0.6, 0.8, 1.0, 1.25, 1.6, 2.5, 4.0)]
    best, means = best_interval(grid, c, m, work_s=30 * 24 * 3600.0, restart_s=120, trials=8)
    assert 0.6 * young <= best <= 1.6 * young
    assert means[young] <= 1.01 * min(means.values())  # Young's interval wastes < 1% more
    assert abs(theory.daly_checkpoint_interval(c, m) - young) / young < 0.1
    assert simulate_wall_time(100, 0, 1e12, 1000) == 1000  # no failure, free checkpoints


def test_the_store_serves_from_a_process_of_its_own_not_a_thread_of_this_one():
    """run_with_failure forks its replicas while the store serves: from another process (the
    launcher's store_main), so no store thread of the forking process can be caught mid-lock."""
    import glob

    from engine.ft.harness import store_in_a_process

    def store_threads():  # PyTorch names a store's server thread pt_tcpstore_uv
        names = (open(f).read().strip() for f in glob.glob("/proc/self/task/*/comm"))
        return sum("tcpstore" in name for name in names)

    before = store_threads()  # another test's store may still be alive in this process
    with store_in_a_process(timeout_s=5.0) as store:
        store.set("key", "value")
        assert store.get("key") == b"value"
        assert store_threads() == before  # one served here would add its server thread
        assert len(descendants()) == 1  # the server
    assert descendants() == []  # killed and reaped


def _failing_loss(model, step, rank):
    raise RuntimeError("a bug in the loss (injected)")


def test_an_error_in_the_loss_is_raised_not_taken_for_a_lost_peer():
    """Only communication errors abort a round and retry it; the caller's own error surfaces
    at once, with its message (it was retried ten times and reported as a failed step)."""
    import torch.distributed as dist

    from engine.ft.replica import FaultTolerantReplica

    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
    model = _model()
    replica = FaultTolerantReplica(store, 0, 1, model, _optimizer(model), deadline_s=1.0)
    with pytest.raises(RuntimeError, match="a bug in the loss"):
        replica.train_step(lambda step: _failing_loss(model, step, 0))
