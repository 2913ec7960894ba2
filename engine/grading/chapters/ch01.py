"""Checks for chapter 01: ring all-reduce from p2p sends, and the volume formulas."""

from __future__ import annotations

import contextlib
import random

import torch
import torch.distributed as dist

from engine import theory
from engine.observe.meter import CommMeter
from engine.comm import ops as engine_ops
from engine.observe.patching import patched
from engine.grading.core import POINT_TO_POINT, CheckFailed, Exercise, passed, run_ranks
from engine.grading.drill import Drill

RING_CASES = [(2, 5), (3, 1001), (4, 3), (4, 64), (3, 1_000_003)]  # awkward counts; ~4 MB
SUBGROUP_CASE = (4, 1001)  # the ring runs on ranks [1, 3] only
TIMEOUT_S = 30
_BUILT_INS = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather",
              "all_gather_into_tensor", "all_gather_single", "broadcast", "reduce")


@contextlib.contextmanager
def _built_in_collectives_blocked():
    """Inside a rank being graded, a collective raises, torch.distributed's or the engine's
    (engine.comm.ops'): the point is to build one."""
    def refuse(*args, **kwargs):
        raise RuntimeError("this exercise builds the all-reduce from point-to-point sends; "
                           "collectives are switched off while it is graded")

    with contextlib.ExitStack() as stack:
        for module in (dist, engine_ops):
            stack.enter_context(patched(module, **{name: refuse for name in _BUILT_INS
                                                   if hasattr(module, name)}))
        yield


def _ring_input(rank: int, numel: int) -> torch.Tensor:
    return ((torch.arange(numel) * 3 + rank * 5) % 13).float()


def _ring_on_rank(rank, world_size, impl, numel, subgroup):
    """A driver (runs where the learner's code does): what the ring left behind, and what the
    meter counted. The check compares it with the sum computed in the grader."""
    # a subgroup to test the learner's ring on, not an axis of the layout: no Mesh needed
    group = dist.new_group([1, 3]) if subgroup else None
    if subgroup and rank not in (1, 3):
        return dict(skip=True)
    t = _ring_input(rank, numel)
    with CommMeter() as meter, _built_in_collectives_blocked():
        out = impl(t, group) if subgroup else impl(t)
    same_memory = (isinstance(out, torch.Tensor) and out.numel() == t.numel()
                   and out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr())
    returned = out.reshape(t.shape) if isinstance(out, torch.Tensor) and \
        out.numel() == t.numel() and not same_memory else None
    return dict(skip=False, tensor=t, same_memory=same_memory, returned=returned,
                sent=meter.bytes_sent, ops=sorted({e.op for e in meter.events}))


def _expected_sum(numel: int, ranks: list[int]) -> torch.Tensor:
    """The all-reduced tensor, computed in the grader (small integers: exact in fp32)."""
    return sum((_ring_input(rank, numel) for rank in ranks), torch.zeros(numel))


def _run_ring(impl, world_size, numel, subgroup=False):
    results = run_ranks(_ring_on_rank, world_size, impl, numel, subgroup, timeout=TIMEOUT_S)
    return [(rank, res) for rank, res in enumerate(results) if not res["skip"]]


def _all_cases(impl):
    for world_size, numel in RING_CASES:
        yield world_size, numel, False, _run_ring(impl, world_size, numel)
    world_size, numel = SUBGROUP_CASE
    yield world_size, numel, True, _run_ring(impl, world_size, numel, subgroup=True)


def check_sums_exactly(impl):
    for world_size, numel, subgroup, results in _all_cases(impl):
        expected = _expected_sum(numel, [1, 3] if subgroup else list(range(world_size)))
        for rank, res in results:
            result = res["returned"] if res["returned"] is not None else res["tensor"]
            if not torch.equal(result, expected):
                raise CheckFailed(f"rank {rank} holds the wrong sum", world_size=world_size,
                                  numel=numel, group="[1, 3]" if subgroup else "world",
                                  got_first=result.flatten()[:4].tolist(),
                                  expected_first=expected[:4].tolist())
            if not (res["same_memory"] and torch.equal(res["tensor"], expected)):
                raise CheckFailed("the sum is right, but write it into the tensor you were "
                                  "given and return that tensor", world_size=world_size,
                                  numel=numel)


def check_sends_2_n_minus_1_over_n(impl):
    largest = {}  # N -> (numel, the most any rank sent / S), on the largest tensor per N
    for world_size, numel, subgroup, results in _all_cases(impl):
        n = 2 if subgroup else world_size
        formula = theory.ring_all_reduce_bytes(numel * 4, n)
        slack = 2 * (n - 1) * 4  # uneven chunks: at most one element per step
        for rank, res in results:
            if not res["ops"] or not POINT_TO_POINT.issuperset(res["ops"]):
                raise CheckFailed("send with point-to-point ops (exchange, ops.isend...) so the "
                                  "meter counts your traffic", ops_seen=res["ops"])
            if abs(res["sent"] - formula) > slack:
                raise CheckFailed(f"rank {rank} sent {res['sent']} bytes; a ring sends "
                                  f"2(N-1)/N·S = {formula:.0f} (± {slack} for uneven chunks)",
                                  world_size=n, numel=numel, tensor_bytes=numel * 4)
        if numel > largest.get(n, (0, 0))[0]:
            largest[n] = (numel, max(res["sent"] for _, res in results) / (numel * 4))
    ns = sorted(largest)
    return passed(f"sent {', '.join(f'{largest[n][1]:.2f}' for n in ns)} x S", "2(N-1)/N",
                  N=", ".join(map(str, ns)))


def _hidden_cases(seed: int = 2026, count: int = 25):
    rng = random.Random(seed)
    return [(rng.choice([1, 4, 100, 2**20, 25e6 * 4, 7e9 * 2]), rng.randint(1, 64))
            for _ in range(count)]


def _check_formula(impl, name, reference):
    for size, n in _hidden_cases():
        got = getattr(impl, name)(size, n)
        if not isinstance(got, (int, float)) or abs(got - reference(size, n)) > 1e-9 * size:
            raise CheckFailed(f"{name} gives {got!r} bytes", size_bytes=size, n=n)


def check_ring_bytes_per_rank(impl):
    _check_formula(impl, "ring_bytes_per_rank", theory.ring_all_reduce_bytes)


def check_ps_worker_bytes(impl):
    _check_formula(impl, "ps_worker_bytes",
                   lambda s, n: theory.ps_all_reduce_bytes(s, n)["worker_sent"])


def check_ps_server_bytes(impl):
    _check_formula(impl, "ps_server_bytes",
                   lambda s, n: theory.ps_all_reduce_bytes(s, n)["server_sent"])


EXERCISES = [
    Exercise(
        name="ch01.ring_all_reduce",
        title="Ring all-reduce from point-to-point sends",
        module="ch01_ring_all_reduce",
        attr="ring_all_reduce",
        checks=(check_sums_exactly, check_sends_2_n_minus_1_over_n),
        hints=(
            "Cut the tensor into N chunks. Reduce-scatter: in N-1 steps every rank passes one "
            "chunk to its right-hand neighbour and adds in the chunk arriving from its left, "
            "until each rank owns one fully summed chunk. All-gather: N-1 more steps pass the "
            "summed chunks around the ring.",
            "chunk_sizes(t.numel(), N) and t.view(-1).split(sizes) give views into t; "
            "exchange(send, right, recv, left, group) sends and receives at once; "
            "dist.get_rank(group), dist.get_world_size(group) and "
            "dist.get_process_group_ranks(group) give the neighbours' global ranks.",
            "reduce-scatter step s: send chunk (r-s-1)%N, receive chunk (r-s-2)%N into a "
            "scratch buffer and add it into that chunk. all-gather step s: send chunk (r-s)%N, "
            "receive chunk (r-s-1)%N straight into place. With N = 1 nothing moves.",
        ),
        blocks=("engine.comm.ring.ring_all_reduce", "engine.comm.ring.ring_reduce_scatter",
                "engine.comm.ring.ring_all_gather", "engine.comm.ring.reduce_scatter_steps",
                "engine.comm.ring.all_gather_steps",
                "engine.comm.ring_pipelined.ring_all_reduce_pipelined",
                "engine.comm.ps.ps_all_reduce", "engine.comm.tree.tree_all_reduce",
                "engine.comm.counted.all_reduce"),
    ),
    Exercise(
        name="ch01.volume_formulas",
        title="Bytes per rank: ring and parameter server",
        module="ch01_volume_formulas",
        attr="",
        checks=(check_ring_bytes_per_rank, check_ps_worker_bytes, check_ps_server_bytes),
        hints=(
            "Count what leaves one rank. A ring moves the tensor in N pieces, twice around the "
            "ring; in a parameter server each worker sends its whole tensor to the server, "
            "which sends the sum back to every worker.",
            "Only arithmetic on size_bytes (S) and n (N), no library call. With N = 1 nobody "
            "sends anything.",
            "ring: 2 (N-1)/N * S. parameter-server worker: S (0 when N = 1). server: (N-1) * S.",
        ),
        blocks=("engine.theory.ring_all_reduce_bytes", "engine.theory.ps_all_reduce_bytes"),
    ),
]

DRILLS = [  # questions from engine.drill's bank: the answers are computed, not typed
    Drill("ch01.ps_server_link", "ps-server-bytes"),
    Drill("ch01.ring_latency_steps", "ring-rounds"),
    Drill("ch01.busbw", "bus-bandwidth"),
    Drill("ch01.ps_against_ring", "ps-vs-ring-total"),
]
