"""Checks for chapter 00's exercise: a broadcast built from point-to-point sends."""

from __future__ import annotations

import torch

from engine.observe.meter import CommMeter
from engine.grading.core import POINT_TO_POINT, CheckFailed, Exercise, passed, run_ranks
from engine.grading.drill import Drill

CASES = [(2, 0), (3, 2), (4, 1)]  # (world_size, src): odd sizes and a source that is not 0
TIMEOUT_S = 20


def _rank_data(rank: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(15, dtype=torch.float64).reshape(3, 5) * 1.5 + 100 * rank).to(dtype)


def _broadcast_on_rank(rank, world_size, impl, src, dtype):
    tensor = _rank_data(rank, dtype)
    before = tensor.clone()
    with CommMeter() as meter:
        out = impl(tensor, src)
    return dict(value=tensor.clone(), same_object=out is tensor, before=before,
                sent=meter.bytes_sent, received=meter.bytes_received,
                ops=sorted({e.op for e in meter.events}))


def _run(impl, world_size, src, dtype=torch.float32):
    return run_ranks(_broadcast_on_rank, world_size, impl, src, dtype, timeout=TIMEOUT_S)


def check_every_rank_gets_the_source_tensor(impl):
    for world_size, src in CASES:
        for dtype in (torch.float32, torch.int64):
            expected = _rank_data(src, dtype)
            for rank, res in enumerate(_run(impl, world_size, src, dtype)):
                if not torch.equal(res["value"], expected):
                    raise CheckFailed(f"rank {rank} holds the wrong values after the broadcast",
                                      world_size=world_size, src=src, dtype=dtype,
                                      got=res["value"].flatten()[:5].tolist(),
                                      expected=expected.flatten()[:5].tolist())


def check_in_place_and_returned(impl):
    for world_size, src in CASES:
        for rank, res in enumerate(_run(impl, world_size, src)):
            if not res["same_object"]:
                raise CheckFailed("return the tensor you were given (fill it in place)",
                                  world_size=world_size, src=src, rank=rank)


def check_traffic_is_n_minus_1_copies(impl):
    copies = []
    for world_size, src in CASES:
        results = _run(impl, world_size, src)
        size = _rank_data(0, torch.float32).numel() * 4
        total_sent = sum(r["sent"] for r in results)
        if not all(r["ops"] and POINT_TO_POINT.issuperset(r["ops"]) for r in results):
            raise CheckFailed("use ops.send/ops.recv (or isend/irecv) so the meter sees the "
                              "traffic, not a collective (built-in or engine.comm.ops')",
                              world_size=world_size, ops_per_rank=[r["ops"] for r in results])
        if total_sent != (world_size - 1) * size:
            raise CheckFailed(f"the ranks sent {total_sent} bytes in all; a broadcast needs "
                              f"exactly N-1 copies = {(world_size - 1) * size}",
                              world_size=world_size, src=src, tensor_bytes=size,
                              sent_per_rank=[r["sent"] for r in results])
        received = [r["received"] for r in results]
        expected = [0 if r == src else size for r in range(world_size)]
        if received != expected:
            raise CheckFailed("each rank but the source should receive the tensor exactly once",
                              world_size=world_size, src=src, received_per_rank=received,
                              expected=expected)
        copies.append(f"{total_sent / size:g}")
    return passed(f"sent {', '.join(copies)} x S in all", "N-1",
                  N=", ".join(str(n) for n, _ in CASES))


EXERCISES = [
    Exercise(
        name="ch00.p2p_broadcast",
        title="Broadcast from point-to-point sends",
        module="ch00_p2p_broadcast",
        attr="p2p_broadcast",
        checks=(check_every_rank_gets_the_source_tensor, check_in_place_and_returned,
                check_traffic_is_n_minus_1_copies),
        hints=(
            "The source holds the data: it sends one copy to every other rank, and every other "
            "rank receives once, from the source. N-1 copies cross the wire in all.",
            "dist.get_rank() and dist.get_world_size() say who is who; ops.send(tensor, dst) "
            "and ops.recv(tensor, src) move the tensor where the meter counts it; receive "
            "straight into `tensor`.",
            "if dist.get_rank() == src: for every peer != src: ops.send(tensor, peer); else: "
            "ops.recv(tensor, src). Return tensor.",
        ),
        blocks=("engine.comm.counted.broadcast",),
    ),
]


DRILLS = [  # questions from engine.drill's bank: the answers are computed, not typed
    Drill("ch00.ring_bytes", "ring-bytes"),
    Drill("ch00.flat_broadcast_root", "flat-broadcast-root"),
]
