"""Ring reduce-scatter, all-gather and all-reduce, built from point-to-point sends.

Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations"
(JPDC 2009). The tensor is cut into N chunks. In each of N-1 steps every rank sends one chunk to
its right neighbour and receives one from its left, both at once:

* reduce-scatter: the received chunk is added into the local one; after N-1 steps rank r holds
  chunk r summed over all ranks;
* all-gather: the received chunk is copied in; after N-1 steps every rank holds every chunk;
* all-reduce = reduce-scatter then all-gather: 2(N-1) steps, and each rank sends (and
  receives) 2(N-1)/N·S bytes for a tensor of S bytes (``theory.ring_all_reduce_bytes``),
  below 2S for any N: the minimum when the ranks themselves do the reduction (in-network
  reduction, NCCL's NVLS or CollNet/SHARP, can do with about S). Exact in bytes when N
  divides the element count; otherwise within one element per step.

Chunks follow :func:`chunk_sizes` (the first ``numel % N`` chunks are one element longer), so
any element count works, even fewer elements than ranks (empty chunks are not sent).

This is the readable ring. :mod:`engine.comm.ring_pipelined` is the same algorithm tuned for
speed (segments, the two phases fused, buffers reused); ``benchmarks/collectives.py`` times both.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from engine.comm import p2p
from engine.comm.checks import check_same_everywhere, validate

Combine = Callable[[torch.Tensor, torch.Tensor], object]  # combine(into, incoming), in place
COMBINE: dict[str, Combine] = {
    "sum": torch.Tensor.add_, "avg": torch.Tensor.add_,
    "max": lambda into, x: torch.maximum(into, x, out=into),
    "min": lambda into, x: torch.minimum(into, x, out=into),
}


def chunk_sizes(numel: int, n: int) -> list[int]:
    """Sizes of the N chunks a ring cuts ``numel`` elements into."""
    q, r = divmod(numel, n)
    return [q + (1 if i < r else 0) for i in range(n)]


def ring_position(group=None) -> tuple[int, int, int, int]:
    """(my index, N, right neighbour, left neighbour) in ``group``; neighbours as global ranks."""
    ranks = p2p.group_ranks(group)
    me = ranks.index(dist.get_rank())
    n = len(ranks)
    return me, n, ranks[(me + 1) % n], ranks[(me - 1) % n]


def start_exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group=None
                   ) -> list:
    """Post the send of ``send`` to ``dst`` and the receive of ``recv`` from ``src`` (empty
    tensors are skipped); return the works to wait on.

    Both go in one ``batch_isend_irecv``, so every rank of the ring sends and receives at once.
    That is also what NCCL needs: a lone receive posted before its send blocks the send queued
    behind it on the same stream, and a two-rank ring then hangs.
    """
    posted = []
    if recv.numel():
        posted.append(p2p.recv_op(recv, src, group))
    if send.numel():
        posted.append(p2p.send_op(send, dst, group))
    return p2p.batch_isend_irecv(posted) if posted else []


def exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group=None) -> None:
    """One ring step: send ``send`` to ``dst`` while receiving ``recv`` from ``src``."""
    for work in start_exchange(send, dst, recv, src, group):
        work.wait()


def reduce_scatter_steps(chunks: list[torch.Tensor], group, combine: Combine) -> None:
    """N-1 steps: at step s, send chunk me-s-1 right and combine chunk me-s-2 from the left.

    The chunk a rank combines at step s is the one it sends at step s+1, so after N-1 steps
    chunk ``me`` has passed through every rank.
    """
    me, n, right, left = ring_position(group)
    for step in range(n - 1):
        into = chunks[(me - step - 2) % n]
        incoming = torch.empty_like(into)
        exchange(chunks[(me - step - 1) % n], right, incoming, left, group)
        combine(into, incoming)


def all_gather_steps(chunks: list[torch.Tensor], group) -> None:
    """N-1 steps: at step s, send chunk me-s right and receive chunk me-s-1 from the left."""
    me, n, right, left = ring_position(group)
    for step in range(n - 1):
        exchange(chunks[(me - step) % n], right, chunks[(me - step - 1) % n], left, group)


def _chunks(t: torch.Tensor, group) -> list[torch.Tensor]:
    return list(t.view(-1).split(chunk_sizes(t.numel(), dist.get_world_size(group))))


def ring_reduce_scatter(t: torch.Tensor, group=None, op="sum", check: bool = True) -> torch.Tensor:
    """Reduce ``t`` across the group; return the view of ``t`` holding this rank's chunk.

    ``t`` is the working buffer: afterwards chunk ``rank`` (see :func:`chunk_sizes`) holds the
    sum (or average) over all ranks, and the other chunks hold partial sums.
    """
    op = validate(t, op)
    if check:
        check_same_everywhere(t, group)
    chunks, me = _chunks(t, group), ring_position(group)[0]
    reduce_scatter_steps(chunks, group, COMBINE[op])
    if op == "avg":
        chunks[me].div_(len(chunks))
    return chunks[me]


def ring_all_gather(t: torch.Tensor, group=None, check: bool = True) -> torch.Tensor:
    """Fill every chunk of ``t`` from the rank that owns it (chunk r comes from rank r).

    In place; returns ``t``. Only chunk ``rank`` of ``t`` needs to be valid on entry.
    """
    validate(t)
    if check:
        check_same_everywhere(t, group)
    all_gather_steps(_chunks(t, group), group)
    return t


def ring_all_reduce(t: torch.Tensor, group=None, op="sum", check: bool = True) -> torch.Tensor:
    """Sum (or average) ``t`` over the group, in place: reduce-scatter, then all-gather."""
    ring_reduce_scatter(t, group, op, check)  # chunk r of t: the sum, on rank r
    all_gather_steps(_chunks(t, group), group)  # every chunk, everywhere
    return t
