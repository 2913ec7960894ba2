"""Counted collectives: inside ``CommMeter(count="wire")`` every collective runs on the engine's
point-to-point algorithms. Same results as the built-in, and bytes counted message by message
that equal the formulas of ``engine.theory``.

Inputs are small integers in floating point, so any summation order gives the same bits and
the counted results must equal the built-in's exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from engine import RankError, theory
from engine.observe.meter import CommMeter
from engine.comm import ops, pairwise_all_to_all
from tests.helpers import run_ranks


def _data(rank: int, numel: int) -> torch.Tensor:
    return ((torch.arange(numel, dtype=torch.float32) * 7 + rank * 3) % 11 - 5)


def _every_collective(rank, world_size, numel, count):
    n = world_size
    results, events = {}, []
    with CommMeter(count=count) as meter:
        for name, op in [("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG),
                         ("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)]:
            t = _data(rank, numel)
            ops.all_reduce(t, op=op)
            results[f"all_reduce {name}"] = t
        out = torch.empty(numel)
        ops.reduce_scatter_tensor(out, torch.cat([_data(rank + j, numel) for j in range(n)]))
        results["reduce_scatter"] = out
        out = torch.empty(n * numel)
        work = ops.all_gather_into_tensor(out, _data(rank, numel), async_op=True)
        work.wait()
        results["all_gather"] = out
        t = _data(rank, numel)
        ops.broadcast(t, src=n - 1)
        results["broadcast"] = t
        t = _data(rank, numel)
        ops.reduce(t, dst=1 % n)
        results["reduce"] = t if rank == 1 % n else None
        inp = torch.cat([torch.full((numel,), 100.0 * rank + j) for j in range(n)])
        out = torch.empty(n * numel)
        ops.all_to_all_single(out, inp)
        results["all_to_all"] = out
    return results, [(e.op, e.bytes_sent, e.bytes_received, e.measured, e.algorithm)
                     for e in meter.events]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_counted_collectives_equal_the_built_ins_and_count_the_formula_bytes(world_size):
    n, numel = world_size, 12  # 12 divides evenly among 2, 3 and 4 ranks
    built_in = run_ranks(_every_collective, n, numel, "model")
    counted = run_ranks(_every_collective, n, numel, "wire")
    size = numel * 4
    for rank, ((expected, _), (got, events)) in enumerate(zip(built_in, counted)):
        for name in expected:
            assert (got[name] is None) == (expected[name] is None), name
            if expected[name] is not None:
                assert torch.equal(got[name], expected[name]), (rank, name)
        formula = {
            "all_reduce": theory.ring_all_reduce_bytes(size, n),
            "reduce_scatter": theory.ring_reduce_scatter_bytes(n * size, n),
            "all_gather": theory.ring_all_gather_bytes(n * size, n),
            "broadcast": theory.chain_broadcast_bytes(size, n, rank, root=n - 1)[0],
            "reduce": theory.chain_broadcast_bytes(size, n, rank, root=1 % n)[1],
            "all_to_all": theory.all_to_all_bytes(n * size, n),
        }
        for op, sent, received, measured, algorithm in events:
            assert measured and algorithm in ("ring", "chain", "pairwise"), (op, algorithm)
            assert sent == formula[op], (rank, op, sent, formula[op])
        assert len(events) == 9


def _uneven_all_to_all(rank, world_size, count):
    n = world_size
    sends = [(rank + j) % 3 for j in range(n)]  # rows rank sends to rank j; 0 rows too
    receives = [(i + rank) % 3 for i in range(n)]
    inp = torch.cat([torch.full((rows, 2), 10.0 * rank + j) for j, rows in enumerate(sends)])
    out = torch.empty(sum(receives), 2)
    with CommMeter(count=count) as meter:
        ops.all_to_all_single(out, inp, receives, sends)
    expected = torch.cat([torch.full((rows, 2), 10.0 * i + rank) for i, rows in
                          enumerate(receives)])
    return torch.equal(out, expected), meter.bytes_sent, meter.bytes_received, sends, receives


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_to_all_with_uneven_splits_equals_the_built_in(world_size):
    for count in ("model", "wire"):
        for rank, (exact, sent, received, sends, receives) in enumerate(
                run_ranks(_uneven_all_to_all, world_size, count)):
            assert exact, (count, rank)
            row = 2 * 4
            assert sent == row * (sum(sends) - sends[rank])
            assert received == row * (sum(receives) - receives[rank])


def _subgroup_counted(rank, world_size):
    evens = dist.new_group([0, 2])
    odds = dist.new_group([1, 3])
    group = evens if rank % 2 == 0 else odds
    t = _data(rank, 10)
    expected = t.clone()
    dist.all_reduce(expected, group=group)
    with CommMeter(count="wire") as meter:
        ops.all_reduce(t, group=group)
    return torch.equal(t, expected), meter.bytes_sent, meter.events[0].group


def test_counted_collectives_run_inside_process_subgroups():
    for rank, (exact, sent, group) in enumerate(run_ranks(_subgroup_counted, 4)):
        assert exact
        assert sent == theory.ring_all_reduce_bytes(40, 2)
        assert group == ((0, 2) if rank % 2 == 0 else (1, 3))


def _mismatched_splits(rank, world_size):
    inp = torch.zeros(4)
    out = torch.zeros(4)
    splits = [2, 2] if rank == 0 else [1, 3]
    pairwise_all_to_all(out, inp, [2, 2], splits)


def test_all_to_all_with_splits_the_ranks_disagree_on_is_a_clear_error():
    with pytest.raises(RankError, match="ranks disagree on the all-to-all"):
        run_ranks(_mismatched_splits, 2)


def test_a_meter_refuses_an_unknown_count_mode():
    with pytest.raises(ValueError, match="count must be one of \\('model', 'wire'\\), got 'all'"):
        CommMeter(count="all")


def _small_ints(rank, world_size):
    got = {}
    for dtype in (torch.uint8, torch.int8):
        built_in, counted = torch.full((5,), rank + 1, dtype=dtype), None
        ops.all_reduce(built_in)
        counted = torch.full((5,), rank + 1, dtype=dtype)
        with CommMeter():
            ops.all_reduce(counted)
        got[str(dtype)] = torch.equal(built_in, counted)
    return got


def test_counted_all_reduce_takes_every_dtype_the_built_in_takes():
    for got in run_ranks(_small_ints, 3):
        assert got == {"torch.uint8": True, "torch.int8": True}


def _all_reduce_bytes(rank, world_size, sizes):
    sent = []
    for numel in sizes:
        with CommMeter(count="wire") as meter:
            ops.all_reduce(torch.ones(numel))
        sent.append(meter.bytes_sent)
    return sent


def test_a_ranks_own_ring_bytes_follow_its_place_when_n_does_not_divide_the_size():
    """``theory.ring_all_reduce_rank_bytes``: the counted ring's bytes rank by rank, for
    sizes 4 ranks do not split evenly (a scalar: 4, 8, 8, 4 B, the mean 6 B of
    ring_all_reduce_bytes on none of them) and one they do."""
    sizes = (1, 7, 10, 13, 12)
    sent = run_ranks(_all_reduce_bytes, 4, sizes)
    for j, numel in enumerate(sizes):
        mine = [theory.ring_all_reduce_rank_bytes(numel, 4, 4, rank) for rank in range(4)]
        assert [s[j] for s in sent] == mine
        assert sum(mine) == 4 * theory.ring_all_reduce_bytes(4 * numel, 4)
    assert [s[0] for s in sent] == [4, 8, 8, 4]
