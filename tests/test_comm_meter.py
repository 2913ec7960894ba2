"""CommMeter: every op recorded with payload and wire bytes that match their definitions."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from engine import theory
from engine.observe.meter import CommMeter
from engine.comm import ops
from tests.helpers import run_ranks

NUMEL = 1200  # divisible by 2, 3 and 4: the ring formulas are exact in bytes


def _builtin_collectives(rank, world_size, src):
    t = torch.full((NUMEL,), float(rank))
    with CommMeter(count="model") as meter:  # the built-ins, their bytes modeled
        ops.all_reduce(t)
        ops.broadcast(t, src)
    return [(e.op, e.payload_bytes, e.bytes_sent, e.bytes_received, e.measured, e.group)
            for e in meter.events], t


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_all_reduce_and_broadcast_counts_match_their_definitions(world_size):
    size = NUMEL * 4
    src = world_size - 1
    for rank, (events, t) in enumerate(run_ranks(_builtin_collectives, world_size, src)):
        assert torch.equal(t, torch.full((NUMEL,), float(sum(range(world_size)))))
        all_reduce, broadcast = events
        wire = 2 * (world_size - 1) * size // world_size  # ring all-reduce: 2(N-1)/N·S each way
        assert all_reduce == ("all_reduce", size, wire, wire, False, tuple(range(world_size)))
        # chain broadcast from src: all but src receive S; all but the chain's end forward S
        is_last = (rank - src) % world_size == world_size - 1
        assert broadcast[:4] == ("broadcast", size, 0 if is_last else size,
                                 0 if rank == src else size)
        assert wire == theory.ring_all_reduce_bytes(size, world_size)


def _flat_p2p_broadcast(rank, world_size, dtype):
    t = torch.arange(NUMEL).to(dtype) if rank == 0 else torch.zeros(NUMEL, dtype=dtype)
    with CommMeter() as meter:
        if rank == 0:
            for peer in range(1, world_size):
                ops.send(t, peer)
        else:
            ops.recv(t, 0)
    return meter.bytes_sent, meter.bytes_received, [e.measured for e in meter.events], t


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64])
def test_point_to_point_traffic_is_counted_exactly(world_size, dtype):
    size = NUMEL * torch.empty(0, dtype=dtype).element_size()
    results = run_ranks(_flat_p2p_broadcast, world_size, dtype)
    for rank, (sent, received, measured, t) in enumerate(results):
        assert (sent, received) == theory.flat_broadcast_bytes(size, world_size, rank, root=0)
        assert all(measured)
        assert torch.equal(t, torch.arange(NUMEL).to(dtype))


def _ring_exchange(rank, world_size):
    send, recv = torch.full((256,), float(rank)), torch.empty(256)
    with CommMeter() as outer:
        with CommMeter() as inner:
            works = ops.batch_isend_irecv([ops.send_op(send, (rank + 1) % world_size),
                                           ops.recv_op(recv, (rank - 1) % world_size)])
            pending = [e.end for e in inner.events]
            for w in works:
                w.wait()
        ops.barrier()
    return (pending, [(e.op, e.peer, e.bytes_sent, e.bytes_received, e.seconds is not None)
                      for e in inner.events], len(outer.events), float(recv[0]))


def test_async_ops_are_stamped_when_waited_and_meters_nest():
    for rank, (pending, events, outer_count, got) in enumerate(run_ranks(_ring_exchange, 3)):
        assert pending == [None, None]  # issued, not yet complete
        assert events == [("isend", (rank + 1) % 3, 1024, 0, True),
                          ("irecv", (rank - 1) % 3, 0, 1024, True)]
        assert outer_count == 3  # the outer meter saw the inner ops and the barrier
        assert got == float((rank - 1) % 3)


def _sharded_collectives(rank, world_size):
    shard = torch.full((100,), float(rank))
    full = torch.empty(100 * world_size)
    out = torch.empty(100)
    with CommMeter() as meter:
        ops.all_gather_into_tensor(full, shard)
        ops.reduce_scatter_tensor(out, full)
    return meter.by_op(), meter.summary(), out


def test_reduce_scatter_and_all_gather_count_the_full_tensor():
    world_size = 4
    full_bytes = 100 * world_size * 4
    for rank, (table, summary, out) in enumerate(run_ranks(_sharded_collectives, world_size)):
        wire = 3 * full_bytes // 4  # (N-1)/N of the full tensor each way
        assert table["all_gather"] == dict(count=1, payload_bytes=400, bytes_sent=wire,
                                           bytes_received=wire)
        assert table["reduce_scatter"] == dict(count=1, payload_bytes=full_bytes,
                                               bytes_sent=wire, bytes_received=wire)
        assert "all_gather" in summary and str(2 * wire) in summary
        # every rank gathered [0]*100 + [1]*100 + ...; summing those, chunk r holds N·r
        assert torch.equal(out, torch.full((100,), float(world_size * rank)))


def test_no_meter_open_records_nothing_and_costs_nothing():
    def rank_fn(rank, world_size):
        t = torch.ones(4)
        ops.all_reduce(t)
        with CommMeter() as m:
            pass
        return len(m.events), float(t[0])

    assert run_ranks(rank_fn, 2) == [(0, 2.0), (0, 2.0)]


class _SaysCuda(torch.Tensor):
    """A CPU tensor that tells the engine's wrappers (engine/comm) it is on CUDA, so that they
    take the path where they would mark the GPU's stream (CUDA events), on a machine without
    a GPU; to torch itself it is the CPU tensor it is."""

    @property
    def is_cuda(self):
        import sys

        return "engine/comm/" in sys._getframe(1).f_code.co_filename


def _every_op(rank, world_size, make):
    peer = 1 - rank
    t = make(torch.ones(8))
    ops.all_reduce(t)
    ops.all_reduce(t, async_op=True).wait()
    ops.broadcast(t, 0)
    ops.reduce(t, 0)
    ops.reduce_scatter_tensor(make(torch.empty(4)), t)
    ops.all_gather_into_tensor(t, make(torch.ones(4)))
    ops.all_to_all_single(make(torch.empty(8)), t)
    ops.all_gather_into_tensor(t, make(torch.ones(4)), async_op=True).wait()
    ops.barrier()
    for send_first in (rank == 0, rank == 1):
        ops.send(t, peer) if send_first else ops.recv(t, peer)
    (ops.isend(t, peer) if rank == 0 else ops.irecv(t, peer)).wait()
    for work in ops.batch_isend_irecv([ops.send_op(t, peer), ops.recv_op(make(torch.empty(8)),
                                                                          peer)]):
        work.wait()


def _what_is_made(rank, world_size):
    from engine.comm import collectives, p2p
    from engine.observe import meter

    made = dict(events=0, records=0, gpu_marks=0, cuda_events=0)

    def counting(key, fn):
        def counted(*args, **kwargs):
            made[key] += 1
            return fn(*args, **kwargs)
        return counted

    for module in (collectives, p2p):
        module.CommEvent = counting("events", module.CommEvent)
        module.record = counting("records", module.record)
    meter.OPEN.gpu_mark = counting("gpu_marks", meter.OPEN.gpu_mark)
    torch.cuda.Event = counting("cuda_events", torch.cuda.Event)
    make = lambda t: t.as_subclass(_SaysCuda)  # noqa: E731
    _every_op(rank, world_size, make)
    unmetered = dict(made)
    with CommMeter(count="model") as open_meter:
        _every_op(rank, world_size, make)
    return unmetered, made, len(open_meter.events)


def test_with_no_meter_open_no_event_and_no_cuda_event_is_made():
    """Every collective and point-to-point op of ops, on a tensor that says it is on CUDA:
    with no meter open nothing is built or recorded and no CUDA event is made; with a meter
    open the same ops make their events and mark the stream (the path is reached)."""
    for unmetered, made, events in run_ranks(_what_is_made, 2):
        assert unmetered == dict(events=0, records=0, gpu_marks=0, cuda_events=0)
        assert made["events"] == made["records"] == events == 14
        assert made["gpu_marks"] == 2 * 8  # each collective's start and end on the stream


def test_unknown_wire_model_is_a_clear_error():
    with pytest.raises(ValueError, match="no wire model for op 'all_to_all'"):
        theory.collective_wire_bytes("all_to_all", 100, 4, 0)
    with pytest.raises(ValueError, match="n \\(number of ranks\\) must be a positive int, got 0"):
        theory.ring_all_reduce_bytes(100, 0)


def _overlapped(rank, world_size):
    import time

    t = torch.ones(1000)
    with CommMeter(count="model") as meter:  # the built-in runs asynchronously
        work = ops.all_reduce(t, async_op=True)
        time.sleep(0.3)  # "compute" while the all-reduce runs
        work.wait()
        send, recv = torch.ones(10), torch.empty(10)
        works = ops.batch_isend_irecv([ops.send_op(send, 1 - rank), ops.recv_op(recv, 1 - rank)])
        for w in works:
            w.wait()  # Gloo's send/recv have no future: stamped here
    return [e.seconds for e in meter.events]


def test_an_overlapped_collective_is_timed_to_its_completion_not_to_wait():
    for seconds in run_ranks(_overlapped, 2):
        assert seconds[0] < 0.2  # a 4 KB all-reduce, not the 0.3 s of compute around it
        assert all(s is not None for s in seconds[1:])


def _outside_the_group(rank, world_size):
    evens = dist.new_group([0, 2])
    t = torch.ones(4)
    with CommMeter() as meter:
        ops.all_reduce(t, group=evens)
    return len(meter.events), float(t[0])


def test_a_rank_outside_the_group_records_nothing_like_torch_does_nothing():
    assert run_ranks(_outside_the_group, 3) == [(1, 2.0), (0, 1.0), (1, 2.0)]


def test_waiting_twice_on_a_receive_returns_at_once():
    def rank_fn(rank, world_size):
        buf = torch.full((4,), float(rank))
        work = ops.isend(buf, 1) if rank == 0 else ops.irecv(buf, 0)
        work.wait()
        work.wait()  # a raw Gloo receive would block here until the timeout
        return float(buf[0])

    assert run_ranks(rank_fn, 2, timeout=10) == [0.0, 0.0]
