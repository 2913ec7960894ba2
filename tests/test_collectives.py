"""Ring, parameter-server and tree collectives built from p2p sends: exact, and metered.

Inputs are integer-valued floats, so every summation order gives the same bits and results
must match ``torch.distributed``'s built-ins exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from engine import RankError, theory
from engine.observe.meter import CommMeter
from engine.comm import (chunk_sizes, ps_all_reduce, ring_all_gather, ring_all_reduce,
                         ring_reduce_scatter, tree_all_reduce)
from tests.helpers import BEYOND_CPU, DEVICE_WORLD_SIZES, rank_device, run_ranks

SIZES = [1, 2, 3, 7, 1000, 1001]  # fewer elements than ranks, and counts N does not divide
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64]
ALL_REDUCES = {"ring": ring_all_reduce, "ps": ps_all_reduce, "tree": tree_all_reduce}


def _data(rank: int, numel: int, dtype) -> torch.Tensor:
    return ((torch.arange(numel) * 7 + rank * 3) % 11 - 5).to(dtype)  # small integers


def _compare_all_reduces(rank, world_size, device="cpu"):
    on = rank_device(device)
    mismatches = []
    for numel in SIZES:
        for dtype in DTYPES:
            ops_to_try = ["sum", "avg"] if dtype.is_floating_point else ["sum"]
            for op in ops_to_try:
                expected = _data(rank, numel, dtype)
                if on.type == "cpu":
                    dist.all_reduce(expected)
                else:  # the built-in on NCCL takes no CPU tensor: add the ranks' data here
                    expected = sum(_data(r, numel, dtype) for r in range(world_size))
                if op == "avg":
                    expected = expected / world_size
                for name, fn in ALL_REDUCES.items():
                    got = _data(rank, numel, dtype).to(on)
                    out = fn(got, op=op)
                    if out is not got or not torch.equal(got.cpu(), expected.to(dtype)):
                        mismatches.append((name, numel, str(dtype), op))
    return mismatches


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_all_reduces_match_the_built_in_exactly(world_size):
    for mismatches in run_ranks(_compare_all_reduces, world_size, timeout=60):
        assert mismatches == []


@pytest.mark.parametrize("device", BEYOND_CPU)
@pytest.mark.parametrize("world_size", DEVICE_WORLD_SIZES)
def test_all_reduces_are_exact_on_each_device(device, world_size):
    for mismatches in run_ranks(_compare_all_reduces, world_size, device, timeout=60,
                                device=device):
        assert mismatches == []


def _scatter_then_gather(rank, world_size, numel, pipelined=False):
    reduce_scatter, all_gather = ring_reduce_scatter, ring_all_gather
    if pipelined:
        import engine.comm.ring_pipelined as tuned

        tuned.SEGMENT_BYTES = 8  # every rank the same: chunks of 3+ elements are segmented
        reduce_scatter = tuned.ring_reduce_scatter_pipelined
        all_gather = tuned.ring_all_gather_pipelined
    full = _data(rank, numel, torch.float32)
    expected = full.clone()
    dist.all_reduce(expected)
    mine = reduce_scatter(full)
    start = sum(chunk_sizes(numel, world_size)[:rank])
    scatter_ok = torch.equal(mine, expected[start:start + mine.numel()])
    buffer = torch.full((numel,), -1.0)
    buffer[start:start + mine.numel()] = _data(rank, numel, torch.float32)[start:start +
                                                                           mine.numel()]
    all_gather(buffer)
    pieces = [_data(r, numel, torch.float32)[sum(chunk_sizes(numel, world_size)[:r]):][
        :chunk_sizes(numel, world_size)[r]] for r in range(world_size)]
    return scatter_ok, torch.equal(buffer, torch.cat(pieces))


@pytest.mark.parametrize("world_size, numel", [(1, 4), (2, 9), (3, 10), (4, 3), (5, 1001)])
def test_reduce_scatter_and_all_gather_own_chunk_rank(world_size, numel):
    assert run_ranks(_scatter_then_gather, world_size, numel) == [(True, True)] * world_size


@pytest.mark.parametrize("world_size, numel", [(1, 4), (2, 9), (3, 10), (4, 3), (5, 1001)])
def test_pipelined_reduce_scatter_and_all_gather_equal_the_readable_ones(world_size, numel):
    assert run_ranks(_scatter_then_gather, world_size, numel, True) == \
        [(True, True)] * world_size


def _pipelined_phases_metered(rank, world_size, numel):
    from engine.comm.ring_pipelined import (ring_all_gather_pipelined,
                                            ring_reduce_scatter_pipelined)

    t = _data(rank, numel, torch.float32)
    expected = t.clone()
    dist.all_reduce(expected)
    expected /= world_size  # integer sums over 2-4: the average is exact in float32
    with CommMeter() as scatter:
        mine = ring_reduce_scatter_pipelined(t, op="avg")
    with CommMeter() as gather:
        ring_all_gather_pipelined(t)
    return scatter.bytes_sent, gather.bytes_sent, torch.equal(t, expected), mine.numel()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_pipelined_reduce_scatter_and_all_gather_each_send_n_minus_1_over_n(world_size):
    size = 60 * 4
    for scatter, gather, averaged, mine in run_ranks(_pipelined_phases_metered, world_size, 60):
        assert scatter == gather == theory.ring_reduce_scatter_bytes(size, world_size)
        assert averaged and mine == 60 // world_size  # avg, then everyone's chunk everywhere


def _metered(rank, world_size, name, numel):
    t = _data(rank, numel, torch.float32)
    with CommMeter() as meter:
        ALL_REDUCES[name](t)
    return meter.bytes_sent, meter.bytes_received, all(e.measured for e in meter.events)


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_ring_sends_2_n_minus_1_over_n_of_the_tensor(world_size):
    size = 60 * 4  # 60 divides by 2..5: the formula is exact
    for sent, received, measured in run_ranks(_metered, world_size, "ring", 60):
        assert sent == received == theory.ring_all_reduce_bytes(size, world_size)
        assert measured
    # an awkward size: within chunk rounding, 2(N-1) steps of at most one element each
    for sent, _, _ in run_ranks(_metered, world_size, "ring", 1001):
        assert abs(sent - theory.ring_all_reduce_bytes(1001 * 4, world_size)) <= \
            2 * (world_size - 1) * 4


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_parameter_server_and_tree_traffic_match_their_formulas(world_size):
    size = 100 * 4
    ps = theory.ps_all_reduce_bytes(size, world_size)
    for rank, (sent, received, _) in enumerate(run_ranks(_metered, world_size, "ps", 100)):
        role = "server" if rank == 0 else "worker"
        assert (sent, received) == (ps[f"{role}_sent"], ps[f"{role}_received"])
    for rank, (sent, received, _) in enumerate(run_ranks(_metered, world_size, "tree", 100)):
        assert (sent, received) == theory.tree_all_reduce_bytes(size, world_size, rank)


def _in_a_subgroup(rank, world_size):
    odds = dist.new_group([1, 3])
    evens = dist.new_group([0, 2])
    mine = odds if rank % 2 else evens
    t = torch.full((5,), float(rank))
    ring_all_reduce(t, group=mine)
    u = torch.full((5,), float(rank))
    tree_all_reduce(u, group=mine)
    v = torch.full((5,), float(rank))
    ps_all_reduce(v, group=mine, server=1 if rank % 2 else 0)
    return t[0].item(), u[0].item(), v[0].item()


def test_collectives_run_inside_a_subgroup():
    assert run_ranks(_in_a_subgroup, 4) == [(2.0,) * 3, (4.0,) * 3, (2.0,) * 3, (4.0,) * 3]


def _point_to_point_on_a_pair(rank, world_size, what):
    from engine.comm import ops

    pair = dist.new_group([0, 1])
    if what == "complex" and rank < 2:  # travels as its real view, as through dist.isend
        got = torch.zeros(3, dtype=torch.complex64)
        receive = ops.irecv(got, 1 - rank, group=pair)
        ops.isend(torch.full((3,), complex(rank, -rank)), 1 - rank, group=pair).wait()
        receive.wait()
        return torch.equal(got, torch.full((3,), complex(1 - rank, rank - 1)))
    if what == "outsider" and rank == 2:
        ops.isend(torch.ones(2), 0, group=pair)
    if what == "peer outside" and rank == 0:
        ops.irecv(torch.ones(2), 2, group=pair)
    return True


def test_point_to_point_ops_call_the_process_group_with_its_checks():
    assert run_ranks(_point_to_point_on_a_pair, 3, "complex") == [True] * 3
    with pytest.raises(RankError, match=r"rank 2.*this rank \(2\) is not in the group \(0, 1\)"):
        run_ranks(_point_to_point_on_a_pair, 3, "outsider")
    with pytest.raises(RankError, match="Global rank 2 is not part of group"):
        run_ranks(_point_to_point_on_a_pair, 3, "peer outside")


def _mismatched(rank, world_size, name="ring_all_reduce"):
    import engine.comm as comm

    getattr(comm, name)(torch.ones(10 + 2 * rank))


@pytest.mark.parametrize("name", ["ring_all_reduce", "ring_reduce_scatter_pipelined",
                                  "ring_all_gather_pipelined"])
def test_different_sizes_on_different_ranks_are_a_clear_error_not_garbage(name):
    with pytest.raises(RankError) as info:
        run_ranks(_mismatched, 2, name)
    assert "rank 0: 10 x torch.float32, rank 1: 12 x torch.float32" in str(info.value)


@pytest.mark.parametrize("make, message", [
    (lambda: torch.ones(4, 4).t(), "must be contiguous"),
    (lambda: torch.ones(4, dtype=torch.bool), "has dtype torch.bool; supported"),
    (lambda: torch.ones(4, dtype=torch.complex64), "has dtype torch.complex64"),
])
def test_bad_tensors_are_rejected_before_any_send(make, message):
    def rank_fn(rank, world_size):
        ring_all_reduce(make())

    with pytest.raises(RankError, match=message):
        run_ranks(rank_fn, 2)


def test_bad_ops_and_servers_are_clear_errors():
    def rank_fn(rank, world_size, what):
        if what == "max":
            ring_all_reduce(torch.ones(3), op="max")
        if what == "int avg":
            tree_all_reduce(torch.ones(3, dtype=torch.int64), op="avg")
        if what == "server":
            ps_all_reduce(torch.ones(3), server=7)

    for what, message in [("max", "op must be one of \\('sum', 'avg'\\)"),
                          ("int avg", "op='avg' needs a floating-point tensor"),
                          ("server", "server=7 is not a rank of the group \\[0, 1\\]")]:
        with pytest.raises(RankError, match=message):
            run_ranks(rank_fn, 2, what)


def test_theory_formulas_and_bus_bandwidth():
    assert theory.ps_all_reduce_bytes(100, 8) == dict(worker_sent=100, worker_received=100,
                                                      server_sent=700, server_received=700)
    assert [theory.tree_all_reduce_bytes(1, 5, r)[0] for r in range(5)] == [3, 1, 2, 1, 1]
    # every tree edge carries S up and S down: the sum over ranks is 2(N-1)·S, like the ring
    assert sum(theory.tree_all_reduce_bytes(1, 5, r)[0] for r in range(5)) == 2 * 4
    assert theory.bus_bandwidth("all_reduce", 1e9, 1.0, 4) == pytest.approx(1.5e9)
    assert theory.bus_bandwidth("all_gather", 1e9, 2.0, 4) == pytest.approx(0.375e9)
    assert theory.bus_bandwidth("broadcast", 1e9, 1.0, 8) == pytest.approx(1e9)
    with pytest.raises(ValueError, match="op must be one of"):
        theory.bus_bandwidth("all_to_all", 1, 1, 2)
    assert theory.all_reduce_steps("tree", 5) == 6 and theory.all_reduce_steps("ring", 5) == 8


def test_alpha_beta_fit_recovers_known_parameters():
    alpha, beta = 50e-6, 1 / 0.4e9
    samples = [(alg, size, n, theory.alpha_beta_time(alg, size, n, alpha, beta))
               for alg in ("ring", "tree") for n in (2, 4) for size in (4e3, 1e6, 64e6)]
    fit_alpha, fit_beta = theory.fit_alpha_beta(samples)
    assert fit_alpha == pytest.approx(alpha, rel=1e-6) and fit_beta == pytest.approx(beta,
                                                                                     rel=1e-6)
    # small messages: the tree's fewer rounds win; large: the ring's fewer bytes win
    assert theory.alpha_beta_time("tree", 4e3, 8, alpha, beta) < \
        theory.alpha_beta_time("ring", 4e3, 8, alpha, beta)
    assert theory.alpha_beta_time("ring", 64e6, 8, alpha, beta) < \
        theory.alpha_beta_time("tree", 64e6, 8, alpha, beta)


def test_alpha_beta_fit_never_returns_a_negative_latency():
    beta = 1e-9
    samples = [("ps", size, 4, beta * theory.all_reduce_critical_bytes("ps", size, 4) - 1e-6)
               for size in (1e6, 1e7, 1e8)]  # a slightly negative intercept, as noise makes
    alpha, fit_beta = theory.fit_alpha_beta(samples)
    assert alpha == 0.0 and fit_beta == pytest.approx(beta, rel=1e-3)


def _segmented(rank, world_size, numel, segment_bytes):
    import engine.comm.ring_pipelined as ring

    ring.SEGMENT_BYTES = segment_bytes  # every rank the same: chunks split into many segments
    t = _data(rank, numel, torch.float32)
    expected = t.clone()
    dist.all_reduce(expected)
    with CommMeter() as meter:
        ring.ring_all_reduce_pipelined(t)
    return torch.equal(t, expected), meter.bytes_sent, len(meter.events)


@pytest.mark.parametrize("world_size, numel, segment_bytes", [
    (2, 1001, 64), (3, 1001, 64), (5, 1001, 100), (4, 7, 4), (3, 3_000_001, 1 << 20)])
def test_pipelined_segments_keep_the_sum_exact_and_the_bytes_unchanged(world_size, numel,
                                                                          segment_bytes):
    for exact, sent, events in run_ranks(_segmented, world_size, numel, segment_bytes):
        assert exact
        assert abs(sent - theory.ring_all_reduce_bytes(numel * 4, world_size)) <= \
            2 * (world_size - 1) * 4
        assert events > 4 * (world_size - 1)  # more than one message per step: segmented


def _every_staged_op(rank, world_size):
    """With host staging forced, each op that stages gives what it gives without staging."""
    from engine.comm import ops

    n, right, left = world_size, (rank + 1) % world_size, (rank - 1) % world_size
    got = {}
    received = torch.zeros(5)
    works = ops.batch_isend_irecv([ops.send_op(torch.full((5,), float(rank)), right),
                                   ops.recv_op(received, left)])
    for work in works:
        work.wait()
    got["batch_isend_irecv"] = torch.equal(received, torch.full((5,), float(left)))
    t = torch.full((4,), float(rank + 1))
    ops.reduce(t, 0)
    got["reduce"] = rank != 0 or torch.equal(t, torch.full((4,), n * (n + 1) / 2))
    out = torch.zeros(2)
    ops.reduce_scatter_tensor(out, torch.arange(2.0 * n), async_op=True).wait()
    got["reduce_scatter"] = torch.equal(out, n * torch.arange(2.0 * rank, 2.0 * rank + 2))
    received = torch.zeros(3)
    work = ops.irecv(received, left)
    ops.isend(torch.full((3,), float(rank)), right).wait()
    work.wait()
    got["irecv"] = torch.equal(received, torch.full((3,), float(left)))
    received.zero_()
    work.wait()  # a second wait copies nothing again
    got["copied back once"] = torch.equal(received, torch.zeros(3))
    gathered = torch.zeros(n)
    ops.all_gather_into_tensor(gathered, torch.tensor([float(rank)]))
    got["all_gather"] = torch.equal(gathered, torch.arange(float(n)))
    return got


@pytest.mark.parametrize("world_size", [2, 3])
def test_ops_staged_through_host_memory_give_the_same_results(world_size):
    for got in run_ranks(_every_staged_op, world_size, device="cpu-staged"):
        assert all(got.values()), got
