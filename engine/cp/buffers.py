"""The working buffers a context-parallel attention holds at its peak, counted as it runs.

Each attention (:mod:`engine.cp.ring`, :mod:`engine.cp.ulysses`, :mod:`engine.cp.allgather`,
:mod:`engine.cp.twod`) calls :func:`hold` with the tensors it has alive at the moment its
sequence-sized buffers peak (the ring: the K/V block in use and the one arriving, and in
backward the dK/dV share and the accumulator travelling; Ulysses: whole-sequence q, k, v and
output for its heads; all-gather: the whole K/V, and dK/dV before the reduce-scatter). Under
:class:`BufferCount` the largest such total per phase is kept, the way :class:`engine.comm.
CommMeter` keeps bytes sent; outside one, :func:`hold` does nothing. The count covers the
attention's own buffers, not q and the output every method keeps (``S/N`` tokens each), and
is compared with :func:`engine.theory.cp_memory_bytes`.
"""

from __future__ import annotations

import torch

_ACTIVE: list["BufferCount"] = []


class BufferCount:
    """``with BufferCount() as count: ...``: ``count.peak`` maps a phase (``"forward"``,
    ``"backward"``) to the most bytes of working buffers held at once in it."""

    def __init__(self):
        self.peak: dict[str, int] = {}

    def __enter__(self) -> "BufferCount":
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)


def hold(phase: str, *tensors: torch.Tensor) -> None:
    """Record that ``tensors`` are alive together now, in ``phase``."""
    if not _ACTIVE:
        return
    total = sum(t.numel() * t.element_size() for t in tensors)
    for count in _ACTIVE:
        count.peak[phase] = max(count.peak.get(phase, 0), total)
