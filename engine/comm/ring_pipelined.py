"""The ring all-reduce of :mod:`engine.comm.ring`, tuned for speed.

Same algorithm, same bytes on the wire (``theory.ring_all_reduce_bytes``); what changes is how
much Python runs per message and how well the wire stays busy. Each change and what it bought
on a 2-core machine is written up in ``benchmarks/README.md``; ``benchmarks/collectives.py``
times this ring, the readable one and the built-in side by side.

* **Segments.** Each chunk moves as up to :data:`MAX_SEGMENTS` pieces of about
  :data:`SEGMENT_BYTES`: one segment is added and sent on while the next is still arriving, as
  Gloo's chunked ring and NCCL do.
* **Receives posted a step ahead**, into one of two scratch buffers, so data flows the moment
  its sender has it.
* **Fused phases.** Each segment of a rank's own chunk starts round the all-gather as soon as its
  last addition is done, instead of after the whole chunk is.
* **Views made once per call** (:class:`_Ring`), and **scratch buffers reused** between calls
  when the caller hands in a :class:`RingBuffers`.

The two phases are also functions of their own, :func:`ring_reduce_scatter_pipelined` and
:func:`ring_all_gather_pipelined` (what :class:`engine.zero.TunedZeroOptimizer` runs).

Every message goes through :func:`engine.comm.p2p.isend` / ``irecv``, the same send path as the
readable ring, so a :class:`~engine.observe.meter.CommMeter` counts both the same way. On NCCL use the
readable ring: unbatched receives posted ahead of their sends can block a two-rank ring there.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from engine.comm import p2p
from engine.comm.checks import check_same_everywhere, validate
from engine.comm.ring import chunk_sizes, ring_position

SEGMENT_BYTES = 2 << 20  # chunks larger than this travel as pipelined segments
MAX_SEGMENTS = 16


def segment_count(chunk_bytes: int) -> int:
    """How many segments a chunk is cut into."""
    return max(1, min(MAX_SEGMENTS, -(-chunk_bytes // SEGMENT_BYTES)))


class RingBuffers:
    """Scratch receive buffers kept between calls, one pair per dtype and device.

    glibc serves an allocation of 32 MB or more with fresh pages from the kernel, and zeroing
    them on first touch is paid on every call unless the buffers are reused. The caller owns
    this object (a benchmark keeps one per rank); nothing is cached at module level.
    """

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}

    def pair(self, numel: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        key = (dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < 2 * numel:
            buf = self._buffers[key] = torch.empty(2 * numel, dtype=dtype, device=device)
        return [buf[:numel], buf[numel:2 * numel]]

    def tensors(self) -> list[torch.Tensor]:
        """The scratch held now (what a memory count should see)."""
        return list(self._buffers.values())


class _Ring(NamedTuple):
    """One call's ring: the tensor cut into chunks and each chunk into segments (views)."""

    me: int
    n: int
    right: int
    left: int
    group: object
    sizes: list[int]
    chunks: list[torch.Tensor]
    segments: list[tuple[torch.Tensor, ...]]  # segments[c]: chunk c's segments


def _plan(t: torch.Tensor, group) -> _Ring:
    me, n, right, left = ring_position(group)
    sizes = chunk_sizes(t.numel(), n)
    chunks = list(t.view(-1).split(sizes))
    k = segment_count(max(sizes) * t.element_size())
    return _Ring(me, n, right, left, group, sizes, chunks, [c.tensor_split(k) for c in chunks])


def ring_all_reduce_pipelined(t: torch.Tensor, group=None, op="sum", check: bool = True,
                              buffers: RingBuffers | None = None) -> torch.Tensor:
    """Sum (or average) ``t`` over the group, in place; returns ``t``. See the module docstring.

    ``buffers``: scratch to reuse between calls (fresh buffers are taken when ``None``).
    """
    op = validate(t, op)
    ring = _checked_plan(t, group, check, "ring_all_reduce_pipelined")
    if ring.n > 1:
        scratch = (buffers or RingBuffers()).pair(max(ring.sizes), t.dtype, t.device)
        sent: list = []
        _reduce_scatter(ring, scratch, op, forward=sent)
        _all_gather(ring, sent)
    return t


def ring_reduce_scatter_pipelined(t: torch.Tensor, group=None, op="sum", check: bool = True,
                                  buffers: RingBuffers | None = None) -> torch.Tensor:
    """:func:`engine.comm.ring_reduce_scatter`, tuned: ``t`` is the working buffer; returns the
    view of ``t`` holding this rank's chunk, summed (or averaged) over the group."""
    op = validate(t, op)
    ring = _checked_plan(t, group, check, "ring_reduce_scatter_pipelined")
    if ring.n > 1:
        scratch = (buffers or RingBuffers()).pair(max(ring.sizes), t.dtype, t.device)
        _reduce_scatter(ring, scratch, op, forward=None)
    return ring.chunks[ring.me]


def ring_all_gather_pipelined(t: torch.Tensor, group=None, check: bool = True) -> torch.Tensor:
    """:func:`engine.comm.ring_all_gather`, tuned: fills every chunk of ``t`` from the rank that
    owns it, in place; returns ``t``. Only chunk ``rank`` needs to be valid on entry."""
    validate(t)
    ring = _checked_plan(t, group, check, "ring_all_gather_pipelined")
    if ring.n > 1:
        _all_gather(ring, [_isend(ring, seg) for seg in ring.segments[ring.me]])
    return t


def _checked_plan(t: torch.Tensor, group, check: bool, name: str) -> _Ring:
    if dist.get_backend(group) == "nccl":
        raise ValueError(f"{name} posts receives ahead of their sends, which can block on "
                         "NCCL; use the readable ring of engine.comm.ring there")
    if check:
        check_same_everywhere(t, group)
    return _plan(t, group)


def _reduce_scatter(ring: _Ring, scratch: list[torch.Tensor], op: str,
                    forward: list | None) -> None:
    """The N-1 reduce-scatter steps. Step s adds chunk (me-s-2), arriving from the left; each
    segment of this rank's own chunk is sent on as the all-gather's first send the moment its
    last addition is done (divided by N first for "avg"), its work appended to ``forward``
    (``None``: a reduce-scatter alone, nothing sent on)."""
    me, n = ring.me, ring.n
    k = len(ring.segments[0])
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
            else:  # own chunk, final: the all-gather starts here
                if op == "avg":
                    seg.div_(n)
                if forward is not None:
                    forward.append(_isend(ring, seg))
        receives = ahead
    for work in sends:
        _wait(work)


def _all_gather(ring: _Ring, sends: list) -> None:
    """The N-1 all-gather steps. Step s receives chunk (me-s-1) from the left; every receive
    lands in its final place, so all are posted at once, and each segment is forwarded to the
    right as soon as it arrives."""
    me, n = ring.me, ring.n
    arriving = [ring.segments[(me - step - 1) % n] for step in range(n - 1)]
    receives = [[_irecv(ring, seg) for seg in segs] for segs in arriving]
    for step in range(n - 1):
        for work, seg in zip(receives[step], arriving[step], strict=True):
            _wait(work)
            if step < n - 2:
                sends.append(_isend(ring, seg))
    for work in sends:
        _wait(work)


def _isend(ring: _Ring, segment: torch.Tensor):
    return p2p.isend(segment, ring.right, ring.group) if segment.numel() else None


def _irecv(ring: _Ring, segment: torch.Tensor):
    return p2p.irecv(segment, ring.left, ring.group) if segment.numel() else None


def _wait(work) -> None:
    if work is not None:  # None: an empty chunk, neither sent nor received
        work.wait()
