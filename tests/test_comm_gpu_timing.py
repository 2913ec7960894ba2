"""The meter's times on a GPU (engine.observe.durations), checked on the CPU with fakes.

No GPU here: a rank on Gloo reports its backend as NCCL (``dist.get_backend``), its tensors
say they are on CUDA to the engine's wrappers (as in test_comm_meter), and every work's
``_get_duration()`` (ProcessGroupNCCL's own timing, once ``TORCH_NCCL_ENABLE_TIMING=1``)
returns a fixed 5 ms and counts its calls, as do the meter's host synchronisations. The real
NCCL path is checked by the last test, marked ``gpu`` (run by scripts/gpu_check.sh).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from engine.observe.meter import CommMeter
from engine.comm import ops
from engine.observe import durations
from engine.launch import backend as launch_backend
from engine.observe.trace import events_from_meter
from tests.helpers import run_ranks

FAKE_MS = 5.0


class _SaysCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA to the engine's wrappers (engine/comm) only."""

    @property
    def is_cuda(self):
        import sys

        return "engine/comm/" in sys._getframe(1).f_code.co_filename


def _ops(rank, make):
    """Three collectives (two in a row, one async) and point-to-point of every kind."""
    peer = 1 - rank
    t = make(torch.ones(256))
    ops.all_reduce(t)
    ops.all_reduce(t)
    ops.broadcast(t, 0, async_op=True).wait()
    (ops.isend(t, peer) if rank == 0 else ops.irecv(t, peer)).wait()
    ops.send(t, peer) if rank == 0 else ops.recv(t, peer)
    for work in ops.batch_isend_irecv([ops.send_op(t, peer),
                                       ops.recv_op(make(torch.empty(256)), peer)]):
        work.wait()
    ops.barrier()  # on a CPU tensor: the host's clock


def _as_if_on_nccl(rank, world_size, nccl_times_itself):
    from engine.launch import device as launch_device
    from engine.observe.clock import Clock

    calls = dict(duration=0, synchronize=0)
    dist.get_backend = lambda group=None: "nccl"
    launch_device.local_gpu = lambda index=None: torch.device("cpu")
    if nccl_times_itself:  # else Gloo's own: "This Backend doesn't support getDuration"
        def duration(work):
            calls["duration"] += 1
            return FAKE_MS
        dist.Work._get_duration = duration
    synchronize = Clock.synchronize

    def counted_synchronize(clock):
        calls["synchronize"] += 1
        synchronize(clock)
    Clock.synchronize = counted_synchronize
    make = lambda t: t.as_subclass(_SaysCuda)  # noqa: E731
    _ops(rank, make)  # no meter open: nothing kept, nothing read
    unmetered = dict(calls)
    with CommMeter(count="model") as meter:
        _ops(rank, make)
        inside = dict(calls)
    with CommMeter(count="wire") as wire:  # the counted ring: 2 steps of send + receive
        ops.all_reduce(make(torch.ones(256)))
    with CommMeter(count="model") as p2p_only:  # no collective, so no CUDA event marked
        t = make(torch.ones(4))
        (ops.isend(t, 1 - rank) if rank == 0 else ops.irecv(t, 1 - rank)).wait()
    events = [(e.op, e.timed_by, e.start, e.end)
              for e in meter.events + wire.events + p2p_only.events]
    return (unmetered, inside, dict(calls), events, meter.summary(),
            [e.args["timed_by"] for e in events_from_meter(meter, rank)])


def test_nccl_times_each_op_read_once_when_the_meter_closes():
    for unmetered, inside, closed, events, summary, traced in run_ranks(_as_if_on_nccl, 2,
                                                                       True):
        assert unmetered == dict(duration=0, synchronize=0)
        assert inside == dict(duration=0, synchronize=0)  # nothing read during the ops
        *ops_, barrier, counted, alone = events
        assert [op for op, *_ in ops_][:3] == ["all_reduce", "all_reduce", "broadcast"]
        for op, timed_by, start, end in ops_:
            assert timed_by == "nccl"
            assert end - start == pytest.approx(FAKE_MS / 1e3, rel=1e-6)  # float sums
        first, second = ops_[0], ops_[1]
        assert second[2] >= first[3]  # one communicator's stream: one op after the other
        assert barrier[1] == "host clock"
        # the counted ring on 2 ranks: 2 steps, each a send and a receive (2 works on Gloo)
        assert counted[1] == "nccl"
        assert counted[3] - counted[2] == pytest.approx(4 * FAKE_MS / 1e3, rel=1e-6)
        assert alone[1] == "nccl" and alone[3] - alone[2] == pytest.approx(FAKE_MS / 1e3,
                                                                            rel=1e-6)
        # one synchronisation per meter closed with NCCL works (one device), and every work
        # asked once: 3 collectives, isend or irecv, send or recv, 2 in the batch, 4 in the
        # ring, 1 alone
        assert closed == dict(duration=3 + 1 + 1 + 2 + 4 + 1, synchronize=3)
        assert "times: nccl (7 ops), host clock (1 op)" in summary
        assert traced == ["nccl"] * 7 + ["host clock"]


def test_without_nccls_timing_the_fallback_is_labelled():
    for _, _, closed, events, summary, _ in run_ranks(_as_if_on_nccl, 2, False):
        assert [t for _, t, *_ in events] == (
            ["cuda-events (compute stream)"] * 3 + ["host clock"] * 5
            + ["cuda-events (compute stream)", "host clock"])
        assert all(end is not None and end >= start for _, _, start, end in events)
        assert closed["synchronize"] == 3
        assert "times: cuda-events (compute stream) (3 ops), host clock (5 ops)" in summary


def test_distinct_works_and_a_missing_duration():
    class Work:
        def __init__(self, ms):
            self.ms = ms

        def _get_duration(self):
            if self.ms is None:
                raise RuntimeError("getDuration only works if timing was enabled")
            return self.ms

    class Part:
        def __init__(self, *works):
            self.works = list(works)

    a, b = ("cuda:0", Work(1.0)), ("cuda:0", Work(2.0))
    assert durations.distinct_works([Part(a), Part(a), Part(b)]) == [a, b]  # a batch: once
    assert durations.distinct_works([Part(a), Part()]) == []  # a message NCCL did not time
    assert durations.duration_ms([a, b]) == 3.0
    assert durations.duration_ms([a, ("cuda:0", Work(None))]) is None


@pytest.fixture
def timing_env(monkeypatch):
    for name in launch_backend.NCCL_TIMING_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    joined = []
    monkeypatch.setattr(launch_backend.dist, "init_process_group",
                        lambda backend, **kw: joined.append(
                            (backend, os.environ.get("TORCH_NCCL_ENABLE_TIMING"))))
    monkeypatch.setattr(launch_backend, "local_gpu", lambda: 0)
    monkeypatch.setattr(launch_backend.torch.cuda, "set_device", lambda device: None)
    return joined


def test_nccl_groups_get_nccl_timing_set_before_they_are_created(timing_env):
    launch_backend.init_process_group("nccl", 10)
    assert timing_env == [("nccl", "1")]


def test_gloo_groups_leave_the_variable_alone(timing_env):
    launch_backend.init_process_group("gloo", 10)
    assert timing_env == [("gloo", None)]
    assert "TORCH_NCCL_ENABLE_TIMING" not in os.environ


@pytest.mark.parametrize("name", launch_backend.NCCL_TIMING_VARIABLES)
def test_the_users_setting_is_kept(timing_env, monkeypatch, name):
    monkeypatch.setenv(name, "0")
    launch_backend.init_process_group("nccl", 10)
    assert os.environ[name] == "0"
    assert timing_env == [("nccl", "0" if name == "TORCH_NCCL_ENABLE_TIMING" else None)]


# -- on a GPU ---------------------------------------------------------------------------------


def _nccl_timed_all_reduce(rank, world_size):
    device = torch.device("cuda", torch.cuda.current_device())
    t = torch.ones(4 << 20, device=device)  # 16 MiB
    gathered = torch.empty_like(t)
    ops.all_reduce(t)  # NCCL's lazy set-up, outside the meter
    with CommMeter(count="model") as meter:
        work = ops.all_reduce(t, async_op=True)
        work.wait()
        ops.all_gather_into_tensor(gathered, t)  # out of place: a copy even on one rank
    [reduced, copied] = meter.events
    return (os.environ.get("TORCH_NCCL_ENABLE_TIMING"), work._get_duration() / 1e3,
            [(e.timed_by, e.seconds) for e in (reduced, copied)])


@pytest.mark.gpu
def test_nccl_times_the_all_reduce_itself():
    """The meter's duration of an NCCL op is NCCL's own (``Work._get_duration``, the events
    ProcessGroupNCCL records on its stream), which the launcher turned on."""
    from engine import launch

    [(variable, nccl_s, timed)] = launch(_nccl_timed_all_reduce, 1, backend="nccl",
                                        timeout=120, quiet=True)
    assert variable == "1"
    (how, seconds), (how_gather, seconds_gather) = timed
    assert how == how_gather == "nccl"
    assert seconds == pytest.approx(nccl_s, rel=1e-6)  # start + d - start: float rounding only
    assert seconds >= 0 and seconds_gather > 0  # one rank's in-place all-reduce may copy nothing
