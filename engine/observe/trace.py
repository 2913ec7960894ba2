"""Timelines: events with a rank, a lane, a start and an end, exported as Chrome trace JSON.

The JSON follows the Trace Event Format (complete events, ``"ph": "X"``, times in
microseconds); open it in https://ui.perfetto.dev or chrome://tracing. Each rank becomes a
process row, each lane (``"comm"``, ``"compute"``, a pipeline stage...) a thread row under it.

Compute timelines are marked with :class:`Clock` (:mod:`engine.observe.clock`, re-exported here): CUDA
events on a GPU, so they time execution, not launch; the meter's events use the same clock.

**Several nodes.** ``time.perf_counter`` is each host's own clock: the timelines of two nodes
(and the pipeline's idle share, computed across ranks) only line up once each rank's times
are moved onto one clock. :func:`clock_offset` measures, after a barrier, how far this rank's
clock is from the group's first rank's (all-gathered readings); :func:`on_clock` shifts
events by it. Exact to within how far apart the ranks leave the barrier: microseconds on one
host, about one network latency across nodes, well below a pipeline action.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable

import torch

from engine.observe.clock import Clock
from engine.comm import ops
from engine.observe.meter import CommMeter

__all__ = ["TraceEvent", "Clock", "events_from_meter", "to_chrome_trace", "from_chrome_trace",
           "clock_offset", "on_clock"]


@dataclass(frozen=True)
class TraceEvent:
    name: str
    rank: int
    start: float  # seconds, on any clock shared by the ranks (time.perf_counter on one host)
    end: float
    lane: str = "main"
    args: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.end < self.start:
            raise ValueError(
                f"event {self.name!r} ends ({self.end}) before it starts ({self.start})"
            )

    @property
    def seconds(self) -> float:
        return self.end - self.start


def events_from_meter(meter: CommMeter, rank: int, lane: str = "comm") -> list[TraceEvent]:
    """One event per completed op the meter recorded on ``rank``; ``args["timed_by"]`` says
    how its times were obtained (``"nccl"``, ``"cuda-events (compute stream)"`` or
    ``"host clock"``: :mod:`engine.observe.durations`)."""
    return [
        TraceEvent(
            name=e.op,
            rank=rank,
            start=e.start,
            end=e.end,
            lane=lane,
            args=dict(
                payload_bytes=e.payload_bytes,
                bytes_sent=e.bytes_sent,
                bytes_received=e.bytes_received,
                peer=e.peer,
                measured=e.measured,
                algorithm=e.algorithm,
                timed_by=e.timed_by,  # how start and end were obtained (engine.observe.durations)
            ),
        )
        for e in meter.events
        if e.end is not None
    ]


def to_chrome_trace(events: Iterable[TraceEvent], path: str | Path | None = None) -> dict:
    """Build (and, given ``path``, write) a Chrome trace; times are shifted to start at 0."""
    events = list(events)
    t0 = min((e.start for e in events), default=0.0)
    lanes: dict[tuple[int, str], int] = {}
    trace = []
    for e in sorted(events, key=lambda e: (e.rank, e.start)):
        tid = lanes.setdefault((e.rank, e.lane), len(lanes))
        trace.append(
            {
                "name": e.name,
                "cat": e.lane,
                "ph": "X",
                "pid": e.rank,
                "tid": tid,
                "ts": (e.start - t0) * 1e6,
                "dur": e.seconds * 1e6,
                "args": e.args,
            }
        )
    for (rank, lane), tid in lanes.items():
        trace.append(
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": lane}}
        )
    for rank in sorted({e.rank for e in events}):
        trace.append(
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}
        )
    doc = {"traceEvents": trace, "displayTimeUnit": "ms"}
    if path is not None:
        Path(path).write_text(json.dumps(doc, indent=1))
    return doc


def from_chrome_trace(source: str | Path | dict) -> list[TraceEvent]:
    """Read the complete events of a Chrome trace back (times in seconds from the trace start)."""
    doc = source if isinstance(source, dict) else json.loads(Path(source).read_text())
    lane_names = {
        (m["pid"], m["tid"]): m["args"]["name"]
        for m in doc["traceEvents"]
        if m.get("ph") == "M" and m.get("name") == "thread_name"
    }
    return [
        TraceEvent(
            name=e["name"],
            rank=e["pid"],
            start=e["ts"] / 1e6,
            end=(e["ts"] + e["dur"]) / 1e6,
            lane=lane_names.get((e["pid"], e["tid"]), e.get("cat", "main")),
            args=e.get("args", {}),
        )
        for e in doc["traceEvents"]
        if e.get("ph") == "X"
    ]


def clock_offset(device=None, group=None,
                 clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds to add to this rank's ``clock`` readings to put them on the clock of ``group``'s
    first rank (see the module docstring). Every rank of ``group`` calls it at the same point:
    a barrier (a one-element all-reduce on ``device``, the rank's device, default the CPU),
    then each reads ``clock`` and the readings are all-gathered."""
    device = torch.device("cpu") if device is None else torch.device(device)
    ops.all_reduce(torch.zeros(1, device=device), group=group)
    mine = torch.tensor([clock()], dtype=torch.float64, device=device)
    everyone = torch.empty(len(ops.group_ranks(group)), dtype=torch.float64, device=device)
    ops.all_gather_into_tensor(everyone, mine, group=group)
    return float(everyone[0] - mine[0])


def on_clock(events: Iterable[TraceEvent], offset: float) -> list[TraceEvent]:
    """``events`` moved by ``offset`` seconds (from :func:`clock_offset`)."""
    return [replace(e, start=e.start + offset, end=e.end + offset) for e in events]
