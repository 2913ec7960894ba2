"""``CommMeter``: what this rank put on the wire, op by op.

Every communication the engine issues goes through the wrappers in :mod:`engine.comm.ops`,
and each wrapper reports one :class:`CommEvent` to every meter that is open on this rank::

    with CommMeter() as meter:
        ops.all_reduce(grad)
    meter.bytes_sent, meter.bytes_received, meter.events

A meter counts in one of two ways, chosen when it is opened, and every event says which way
its numbers were obtained (``measured``):

* ``count="wire"`` (the default): **counted**. While the meter is open, every collective the
  engine issues (all-reduce, reduce-scatter, all-gather, broadcast, reduce, all-to-all) runs
  on the engine's own point-to-point implementations (the ring, the chain, the pairwise exchange of
  :mod:`engine.comm.counted`), and its bytes are the sum of the messages it actually sent and
  received. Results are the same as the built-in's (the tests check every strategy); an
  ``async_op=True`` call runs to completion before it returns, so overlap is not shown.
  Open the meter on *every* rank of a group: ranks that disagree on the mode would run two
  different algorithms against each other.
* ``count="model"``: the built-in collectives of Gloo or NCCL run, fast and overlapped, and
  their wire bytes are **modeled** by the bandwidth-optimal ring/chain algorithm
  (:func:`engine.theory.collective_wire_bytes`, the model behind nccl-tests' bus bandwidth).
  Use it to time, or to see overlap; every number the course calls measured is counted.

Point-to-point ops (``send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv``) are
counted exactly in both modes: a send of ``S`` bytes puts ``S`` bytes on the wire.

Each event also says what it was sent for (``purpose``, e.g. ``"cp"`` or ``"ep"``), when the
layer that issued it said so with :class:`comm_purpose` around the call: two groups can hold the
same ranks (with dp = 1 the context-parallel group *is* dp x cp), so the ranks alone cannot
always name the traffic (:func:`engine.compose.traffic.kind_of` reads the purpose first). The
purpose is per thread, and an autograd function that issues collectives sets it in its
backward too: on CUDA, backward runs on autograd's own thread.

Each event also says how its start and end were obtained (``timed_by``): on NCCL, by NCCL's
own events on its communication stream (``"nccl"``, read from the op's work when the meter
closes, so no host synchronisation is added inside a step); otherwise by CUDA events on the
compute stream or by the host's clock (:mod:`engine.observe.durations`).

Each rank is its own process, so a meter sees only its own rank; gather per-rank numbers with
the return value of :func:`engine.launch`.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

from engine.observe.clock import Clock
from engine.observe import durations

COUNT_MODES = ("model", "wire")
_PURPOSE = threading.local()  # .name: what the ops this thread issues now are for


def current_purpose() -> str:
    """What the ops this thread issues now are for (``""``: not said; :class:`comm_purpose`)."""
    return getattr(_PURPOSE, "name", "")


class comm_purpose:
    """``with comm_purpose("cp"):`` every event created on this thread inside it (a collective,
    its messages, a point-to-point op) records ``purpose="cp"``. Nests (the inner one wins) and
    costs one thread-local write each way; an event reads it only when a meter records one.
    Set it *inside* the function that issues the collective, forward and backward: autograd may
    run backward on another thread (CUDA), where a purpose set around ``loss.backward()`` is not
    seen (:func:`engine.comm.autograd.all_to_all` carries its forward's purpose into its
    backward)."""

    __slots__ = ("name", "previous")

    def __init__(self, name: str):
        if not isinstance(name, str):
            raise TypeError(f"comm_purpose takes a name (a str such as 'cp'), got {name!r}")
        self.name = name

    def __enter__(self) -> "comm_purpose":
        self.previous = current_purpose()
        _PURPOSE.name = self.name
        return self

    def __exit__(self, *exc) -> None:
        _PURPOSE.name = self.previous


@dataclass
class CommEvent:
    """One communication op as seen by this rank."""

    op: str  # "send", "recv", "all_reduce", "broadcast", "all_to_all", ...
    group: tuple[int, ...]  # global ranks of the group the op ran on
    payload_bytes: int  # size of the tensor handed to the op on this rank
    bytes_sent: int  # bytes this rank put on the wire
    bytes_received: int  # bytes this rank took off the wire
    measured: bool  # True: counted message by message. False: modeled (built-in collective)
    algorithm: str  # "p2p", or the collective's algorithm ("ring", "chain", "pairwise")
    start: float  # time.perf_counter() when the op was issued
    end: float | None = None  # when it completed (async ops: when waited on)
    peer: int | None = None  # the other rank of a point-to-point op (the root of a broadcast)
    dtype: str = ""
    messages: int = 0  # counted collectives: the point-to-point messages it was made of
    # CUDA tensors: events on the stream at issue and at completion, turned into start/end
    # when the meter closes by engine.observe.clock (the host's clock would time the launch, not the
    # transfer)
    gpu_marks: list = field(default_factory=list, repr=False)
    # how start and end were obtained: "nccl" (NCCL's own events on its stream, from the
    # works kept below), "cuda-events (compute stream)" or "host clock" (engine.observe.durations)
    timed_by: str = durations.HOST
    works: list = field(default_factory=list, repr=False)  # read when the meter closes
    # what it was sent for ("cp", "ep", ...; "" when not said): the purpose current on the
    # issuing thread when the event was made (comm_purpose), read by every creator of events
    purpose: str = field(default_factory=current_purpose)

    @property
    def seconds(self) -> float | None:
        return None if self.end is None else self.end - self.start


@dataclass
class CommMeter:
    """Context manager recording every op the engine issues on this rank while it is open.

    ``count``: ``"wire"`` (default) to run collectives on the engine's point-to-point algorithms
    and count their bytes, ``"model"`` to run the built-ins, fast and overlapped, and model
    their bytes (see the module docstring). Meters nest: an op is recorded by every open
    meter, and collectives are counted while any open meter counts the wire.
    """

    count: str = "wire"
    events: list[CommEvent] = field(default_factory=list)
    started_at: float | None = None

    def __post_init__(self):
        if self.count not in COUNT_MODES:
            raise ValueError(f"count must be one of {COUNT_MODES}, got {self.count!r}")

    def __enter__(self) -> "CommMeter":
        self.started_at = time.perf_counter()
        OPEN.meters.append(self)
        return self

    def __exit__(self, *exc) -> None:
        OPEN.meters.remove(self)
        OPEN.resolve_times(self.events)

    @property
    def bytes_sent(self) -> int:
        return sum(e.bytes_sent for e in self.events)

    @property
    def bytes_received(self) -> int:
        return sum(e.bytes_received for e in self.events)

    @property
    def all_counted(self) -> bool:
        """True when every event's bytes were counted, none modeled."""
        return all(e.measured for e in self.events)

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

    def by_group(self) -> dict[tuple[int, ...], dict[str, int]]:
        """``{group ranks: {"count", "bytes_sent", "bytes_received"}}``: traffic per group."""
        table: dict[tuple[int, ...], dict[str, int]] = defaultdict(
            lambda: dict(count=0, bytes_sent=0, bytes_received=0))
        for e in self.events:
            row = table[e.group]
            row["count"] += 1
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
        lines.append("bytes: " + ("counted on the wire" if self.all_counted else
                                  "built-in collectives modeled (open CommMeter(count='wire') "
                                  "to count them)"))
        lines.append("times: " + self.timed_by_line())
        return "\n".join(lines)

    def timed_by_line(self) -> str:
        """How the events' durations were obtained, e.g. ``"nccl (3 ops), host clock (2 ops)"``
        (see :mod:`engine.observe.durations`)."""
        counts: dict[str, int] = defaultdict(int)
        for e in self.events:
            counts[e.timed_by] += 1
        return ", ".join(f"{how} ({n} op{'s' if n != 1 else ''})" for how, n in counts.items()) \
            or "no ops"

    def clear(self) -> None:
        self.events.clear()


class _OpenMeters:
    """This process's open meters, and the counted collective being assembled, if any.

    One per process (each rank is a process); the wrappers in :mod:`engine.comm.ops` report to
    it. It is module state on purpose, the one piece the engine keeps: a meter must see ops
    issued from anywhere (gradient hooks, autograd's threads) without being passed down.
    """

    def __init__(self):
        self.meters: list[CommMeter] = []
        self.parts: list[list[CommEvent]] = []  # stack: messages of counted collectives
        self.clocks: dict = {}  # device -> its Clock (engine.observe.clock), made at its first mark

    def gpu_mark(self, device):
        """``(device, CUDA event recorded now on its current stream)``, for an event's
        ``gpu_marks`` (turned into seconds by :meth:`resolve_times`)."""
        if device not in self.clocks:  # once per device: one synchronisation
            self.clocks[device] = Clock(device)
        return device, self.clocks[device].mark()

    def resolve_times(self, events) -> None:
        """Turn the CUDA events and NCCL works of ``events`` into ``perf_counter`` seconds
        (:func:`engine.observe.durations.resolve`)."""
        durations.resolve(events, self.clocks)

    def recording(self) -> bool:
        return bool(self.meters)

    def counting_wire(self) -> bool:
        return any(m.count == "wire" for m in self.meters)


OPEN = _OpenMeters()


def recording() -> bool:
    """Whether any meter is open on this rank (the wrappers skip building events otherwise)."""
    return OPEN.recording()


def counting_wire() -> bool:
    """Whether collectives must run on the engine's point-to-point algorithms, to be counted."""
    return OPEN.counting_wire()


def record(event: CommEvent) -> CommEvent:
    """Hand ``event`` to every open meter (called by the wrappers in :mod:`engine.comm.ops`).

    A message sent inside a counted collective goes to that collective instead, which reports
    one event with the sum of its messages (:func:`collecting_messages`).
    """
    if OPEN.parts:
        OPEN.parts[-1].append(event)
        return event
    for meter in OPEN.meters:
        meter.events.append(event)
    return event


class collecting_messages:
    """``with collecting_messages() as parts:`` gathers the point-to-point events issued inside
    it into ``parts`` instead of reporting them, so that a counted collective can report one
    event made of them."""

    def __enter__(self) -> list[CommEvent]:
        OPEN.parts.append([])
        return OPEN.parts[-1]

    def __exit__(self, *exc) -> None:
        OPEN.parts.pop()
