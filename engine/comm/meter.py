"""``CommMeter``: what this rank put on the wire, op by op.

Every communication the engine issues goes through the wrappers in :mod:`engine.comm.ops`,
and each wrapper reports one :class:`CommEvent` to every meter that is open on this rank::

    with CommMeter() as meter:
        ops.all_reduce(grad)
    meter.bytes_sent, meter.bytes_received, meter.events

Two kinds of numbers, and each event says which it holds (``measured``):

* **Point-to-point** ops (``send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv``) are
  counted exactly: a send of a tensor of ``S`` bytes puts ``S`` bytes on the wire. Collectives
  the engine builds from them (the ring, the parameter server, ...) are therefore *measured*.
* **Built-in collectives** (``dist.all_reduce`` and friends) hide their algorithm inside Gloo or
  NCCL, so their wire bytes are *modeled*: the bandwidth-optimal ring/chain algorithm NCCL uses
  (:func:`engine.theory.collective_wire_bytes`), the same model behind nccl-tests' bus bandwidth.

Each rank is its own process, so a meter sees only its own rank; gather per-rank numbers with
the return value of :func:`engine.launch`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

_OPEN_METERS: list["CommMeter"] = []


@dataclass
class CommEvent:
    """One communication op as seen by this rank."""

    op: str  # "send", "recv", "all_reduce", "broadcast", ...
    group: tuple[int, ...]  # global ranks of the group the op ran on
    payload_bytes: int  # size of the tensor handed to the op on this rank
    bytes_sent: int  # bytes this rank put on the wire
    bytes_received: int  # bytes this rank took off the wire
    measured: bool  # True: counted p2p traffic. False: modeled (built-in collective)
    algorithm: str  # "p2p" for counted traffic, else the model used ("ring", "chain")
    start: float  # time.perf_counter() when the op was issued
    end: float | None = None  # when it completed (async ops: when waited on)
    peer: int | None = None  # the other rank of a point-to-point op
    dtype: str = ""

    @property
    def seconds(self) -> float | None:
        return None if self.end is None else self.end - self.start


@dataclass
class CommMeter:
    """Context manager recording every op the engine issues on this rank while it is open.

    Meters nest: an op is recorded by every open meter.
    """

    events: list[CommEvent] = field(default_factory=list)
    started_at: float | None = None

    def __enter__(self) -> "CommMeter":
        self.started_at = time.perf_counter()
        _OPEN_METERS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _OPEN_METERS.remove(self)

    @property
    def bytes_sent(self) -> int:
        return sum(e.bytes_sent for e in self.events)

    @property
    def bytes_received(self) -> int:
        return sum(e.bytes_received for e in self.events)

    def by_op(self) -> dict[str, dict[str, int]]:
        """``{op: {"count", "payload_bytes", "bytes_sent", "bytes_received"}}``."""
        table: dict[str, dict[str, int]] = defaultdict(
            lambda: dict(count=0, payload_bytes=0, bytes_sent=0, bytes_received=0))
        for e in self.events:
            row = table[e.op]
            row["count"] += 1
            row["payload_bytes"] += e.payload_bytes
            row["bytes_sent"] += e.bytes_sent
            row["bytes_received"] += e.bytes_received
        return dict(table)

    def summary(self) -> str:
        """A small fixed-width table of :meth:`by_op`, for printing from a rank."""
        lines = [f"{'op':<22}{'count':>6}{'payload B':>12}{'sent B':>12}{'recv B':>12}"]
        for op, row in self.by_op().items():
            lines.append(f"{op:<22}{row['count']:>6}{row['payload_bytes']:>12}"
                         f"{row['bytes_sent']:>12}{row['bytes_received']:>12}")
        lines.append(f"{'total':<22}{len(self.events):>6}{'':>12}"
                     f"{self.bytes_sent:>12}{self.bytes_received:>12}")
        return "\n".join(lines)

    def clear(self) -> None:
        self.events.clear()


def recording() -> bool:
    """Whether any meter is open on this rank (the wrappers skip building events otherwise)."""
    return bool(_OPEN_METERS)


def record(event: CommEvent) -> CommEvent:
    """Hand ``event`` to every open meter (called by the wrappers in :mod:`engine.comm.ops`)."""
    for meter in _OPEN_METERS:
        meter.events.append(event)
    return event
