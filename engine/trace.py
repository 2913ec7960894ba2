"""Timelines: events with a rank, a lane, a start and an end, exported as Chrome trace JSON.

The JSON follows the Trace Event Format (complete events, ``"ph": "X"``, times in
microseconds); open it in https://ui.perfetto.dev or chrome://tracing. Each rank becomes a
process row, each lane (``"comm"``, ``"compute"``, a pipeline stage...) a thread row under it.

Compute timelines are marked with :class:`Clock` (:mod:`engine.clock`, re-exported here): CUDA
events on a GPU, so they time execution, not launch; the meter's events use the same clock.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

from engine.clock import Clock
from engine.comm.meter import CommMeter

__all__ = ["TraceEvent", "Clock", "events_from_meter", "to_chrome_trace", "from_chrome_trace",
           "as_dicts"]


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
    """One event per completed op the meter recorded on ``rank``."""
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


def as_dicts(events: Iterable[TraceEvent]) -> list[dict]:
    """Plain dicts, handy to return from a rank or to build a table."""
    return [asdict(e) for e in events]
