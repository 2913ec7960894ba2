"""Ring reduce-scatter, all-gather and all-reduce, built from point-to-point sends.

Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations"
(JPDC 2009). The tensor is cut into N chunks. In each of N-1 steps every rank sends one chunk to
its right neighbour and receives one from its left, all at once:

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
"""

from __future__ import annotations

import threading
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from engine.comm import ops
from engine.comm.checks import check_same_everywhere, validate
from engine.comm.meter import recording


def chunk_sizes(numel: int, n: int) -> list[int]:
    """Sizes of the N chunks a ring cuts ``numel`` elements into."""
    q, r = divmod(numel, n)
    return [q + (1 if i < r else 0) for i in range(n)]


def _ring(group):
    """(my index, N, right neighbour, left neighbour) in ``group``; neighbours as global ranks."""
    ranks = ops.group_ranks(group)
    me = ranks.index(dist.get_rank())
    n = len(ranks)
    return me, n, ranks[(me + 1) % n], ranks[(me - 1) % n]


def exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group=None) -> None:
    """Send ``send`` to ``dst`` while receiving ``recv`` from ``src``; both metered.

    Both are posted before either is waited on, so every rank of a ring sends and receives at
    once. (A plain isend/irecv pair measured 1.9x faster than ``batch_isend_irecv`` on Gloo
    here: 0.6 ms against 1.1 ms per exchange of 64 bytes on 4 ranks.)
    """
    works = []
    if recv.numel():
        works.append(ops.irecv(recv, src, group))
    if send.numel():
        works.append(ops.isend(send, dst, group))
    for work in works:
        work.wait()


SEGMENT_BYTES = 2 << 20  # chunks larger than this travel as pipelined segments
MAX_SEGMENTS = 16


def segment_count(chunk_bytes: int) -> int:
    """How many segments a chunk is cut into, so that adding (or forwarding) one segment
    overlaps with the next one's transfer, as Gloo's chunked ring and NCCL do."""
    return max(1, min(MAX_SEGMENTS, -(-chunk_bytes // SEGMENT_BYTES)))


class _Ring(NamedTuple):
    """One call's ring: how to reach its neighbours, and the tensor cut into chunks and each
    chunk into segments, as views of the caller's tensor made once per call.

    Python work per message is what a ring built from sends pays over the built-in. On 4 ranks
    sharing 2 cores, making the views once instead of at every step took the 16 MB all-reduce
    from 1.08-1.20x the built-in's time to 1.04-1.09x (medians of 30, same runs).
    """

    me: int
    n: int
    sizes: list[int]  # chunk sizes (chunk_sizes)
    chunks: list[torch.Tensor]
    segments: list[tuple[torch.Tensor, ...]]  # segments[c]: chunk c's segments
    send: Callable[[torch.Tensor], object]  # to the right neighbour; returns a work
    recv: Callable[[torch.Tensor], object]  # from the left neighbour; returns a work


def _plan(t: torch.Tensor, group) -> _Ring:
    me, n, right, left = _ring(group)
    sizes = chunk_sizes(t.numel(), n)
    chunks = list(t.view(-1).split(sizes))
    k = segment_count(max(sizes) * t.element_size())
    send, recv = _links(t, group, right, left)
    return _Ring(me, n, sizes, chunks, [c.tensor_split(k) for c in chunks], send, recv)


def _links(t: torch.Tensor, group, right: int, left: int):
    """How this call sends to the right and receives from the left.

    Through :mod:`engine.comm.ops`, so every message is metered, whenever a
    :class:`~engine.comm.CommMeter` is open (or the tensor must go through host memory).
    Otherwise nobody is counting, and the ring calls the process group itself: on 4 ranks
    sharing 2 cores the wrappers' Python, paid on each of the 24 messages a rank sends and
    receives in a 16 MB all-reduce, made it 0-5% slower (nine runs of 80-150 paired repeats).
    Each work is waited on exactly once, which is all a raw process-group work allows.
    """
    if recording() or ops.stages_through_host(t, group):
        return (lambda seg: ops.isend(seg, right, group),
                lambda seg: ops.irecv(seg, left, group))
    pg, right_in_pg = ops.process_group_and_rank(group, right)
    _, left_in_pg = ops.process_group_and_rank(group, left)
    return (lambda seg: pg.send([seg], right_in_pg, 0),
            lambda seg: pg.recv([seg], left_in_pg, 0))


def ring_reduce_scatter(t: torch.Tensor, group=None, op="sum", check: bool = True) -> torch.Tensor:
    """Reduce ``t`` across the group; return the view of ``t`` holding this rank's chunk.

    ``t`` is the working buffer: afterwards chunk ``rank`` (see :func:`chunk_sizes`) holds the
    sum (or average) over all ranks, and the other chunks hold partial sums.
    """
    op = validate(t, op)
    if check:
        check_same_everywhere(t, group)
    ring = _plan(t, group)
    if ring.n > 1:
        _reduce_scatter(ring, t, op, forward=None)
    if op == "avg":
        ring.chunks[ring.me].div_(ring.n)
    return ring.chunks[ring.me]


def ring_all_gather(t: torch.Tensor, group=None, check: bool = True) -> torch.Tensor:
    """Fill every chunk of ``t`` from the rank that owns it (chunk r comes from rank r).

    In place; returns ``t``. Only chunk ``rank`` of ``t`` needs to be valid on entry.
    """
    validate(t)
    if check:
        check_same_everywhere(t, group)
    ring = _plan(t, group)
    if ring.n > 1:
        _all_gather(ring, sent=None)
    return t


def ring_all_reduce(t: torch.Tensor, group=None, op="sum", check: bool = True) -> torch.Tensor:
    """Sum (or average) ``t`` over the group, in place, with a ring; returns ``t``.

    The reduce-scatter then the all-gather, fused: each segment of a rank's own chunk starts
    round the ring as soon as it is fully reduced, instead of after the whole chunk is.
    """
    op = validate(t, op)
    if check:
        check_same_everywhere(t, group)
    ring = _plan(t, group)
    if ring.n > 1:
        sent: list = []
        _reduce_scatter(ring, t, op, forward=sent)
        _all_gather(ring, sent)
    return t


def _reduce_scatter(ring: _Ring, t: torch.Tensor, op: str, forward: list | None) -> None:
    """The N-1 reduce-scatter steps. Step s adds chunk (me-s-2), arriving from the left.

    Two things keep the wire busy. Receives are posted one step ahead, into one of two
    scratch buffers, so data flows the moment its sender has it. And each chunk moves as
    :func:`segment_count` segments: a segment is added and sent on (the chunk just reduced is
    exactly the one to send next) while the following segment is still arriving.

    ``forward`` (a list) fuses the two phases: each segment of this rank's own chunk goes to
    the right, as the all-gather's first send, the moment its last addition is done (divided
    by N first for "avg"); its send works are appended to the list.
    """
    me, n = ring.me, ring.n
    k = len(ring.segments[0])
    scratch = _scratch(max(ring.sizes), t.dtype, t.device)
    incoming = [scratch[step % 2][: ring.sizes[(me - step - 2) % n]].tensor_split(k)
                for step in range(n - 1)]
    last = n - 2
    receives = [_irecv(ring, seg) for seg in incoming[0]]
    sends = [_isend(ring, seg) for seg in ring.segments[(me - 1) % n]]
    for step in range(n - 1):
        ahead = [_irecv(ring, seg) for seg in incoming[step + 1]] if step < last else []
        for work, seg, arrived in zip(receives, ring.segments[(me - step - 2) % n],
                                      incoming[step], strict=True):
            _wait(work)
            seg.add_(arrived)
            if step < last:
                sends.append(_isend(ring, seg))
            elif forward is not None:  # own chunk, final: the all-gather starts here
                if op == "avg":
                    seg.div_(n)
                forward.append(_isend(ring, seg))
        receives = ahead
    for work in sends:
        _wait(work)


def _all_gather(ring: _Ring, sent: list | None) -> None:
    """The N-1 all-gather steps. Step s receives chunk (me-s-1) from the left.

    Every receive lands in its final place, so all are posted at once, and each segment is
    forwarded to the right as soon as it arrives. ``sent``: the works of this rank's own
    chunk, already sent by a fused reduce-scatter (None: send it now).
    """
    me, n = ring.me, ring.n
    arriving = [ring.segments[(me - step - 1) % n] for step in range(n - 1)]
    receives = [[_irecv(ring, seg) for seg in segs] for segs in arriving]
    sends = sent if sent is not None else [_isend(ring, seg)
                                           for seg in ring.segments[me]]
    for step in range(n - 1):
        for work, seg in zip(receives[step], arriving[step], strict=True):
            _wait(work)
            if step < n - 2:
                sends.append(_isend(ring, seg))
    for work in sends:
        _wait(work)


_SCRATCH: dict[tuple, torch.Tensor] = {}


def _scratch(numel: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Two receive buffers of ``numel`` elements for the reduce-scatter.

    On the CPU they are kept between calls (one pair per thread and dtype, grown as needed):
    glibc serves an allocation of 32 MB or more with fresh pages from the kernel, and zeroing
    them on first touch cost the 64 MB all-reduce on 4 ranks 1.25-1.33x the built-in's time,
    against 0.96-1.05x with the buffers reused (benchmarks/collectives.py, 2-core machine).
    CUDA's caching allocator already reuses memory, so there a fresh pair is taken.
    """
    if device.type != "cpu":
        return [torch.empty(numel, dtype=dtype, device=device) for _ in range(2)]
    key = (threading.get_ident(), dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < 2 * numel:
        buf = _SCRATCH[key] = torch.empty(2 * numel, dtype=dtype)
    return [buf[:numel], buf[numel:2 * numel]]


def _isend(ring: _Ring, segment: torch.Tensor):
    return ring.send(segment) if segment.numel() else None


def _irecv(ring: _Ring, segment: torch.Tensor):
    return ring.recv(segment) if segment.numel() else None


def _wait(work) -> None:
    if work is not None:  # None: an empty chunk, neither sent nor received
        work.wait()
