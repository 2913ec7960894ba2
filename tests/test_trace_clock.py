"""engine.observe.trace.clock_offset: ranks whose clocks disagree (two nodes) are put on the first
rank's clock, so their timelines and the pipeline's idle share line up. Checked on CPU ranks
whose clock is shifted by 1000 s per rank."""

from __future__ import annotations

import time

import pytest

from engine.comm import ops
from engine.pp import measured_idle
from engine.observe.trace import TraceEvent, clock_offset, on_clock
from tests.helpers import run_ranks

SHIFT_S = 1000.0


def _node_clock(rank):
    return lambda: time.perf_counter() + SHIFT_S * rank  # as if each rank were its own node


def _timeline(rank, world_size):
    clock = _node_clock(rank)
    offset = clock_offset(clock=clock)
    ops.barrier()
    start = clock()  # the ranks leave the barrier together: one moment, read on two clocks
    event = TraceEvent("F0", rank, start, start + 0.2, lane="compute")
    return offset, event


@pytest.mark.parametrize("world_size", [2, 3])
def test_clock_offset_puts_shifted_clocks_on_rank_zeros(world_size):
    results = run_ranks(_timeline, world_size)
    raw = [event for _, event in results]
    aligned = [e for offset, event in results for e in on_clock([event], offset)]
    for rank, (offset, _) in enumerate(results):
        assert offset == pytest.approx(-SHIFT_S * rank, abs=0.5)
    assert max(e.start for e in raw) - min(e.start for e in raw) >= SHIFT_S - 1
    assert max(e.start for e in aligned) - min(e.start for e in aligned) < 0.5
    assert min(measured_idle(raw).values()) > 0.99  # nonsense: the clocks are 1000 s apart
    assert max(measured_idle(aligned).values()) < 0.8  # the same 0.2 s, side by side
