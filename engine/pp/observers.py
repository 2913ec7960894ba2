"""What a pipeline rank is seen doing while it runs its schedule, kept out of the runtime that
does it (:func:`engine.pp.run_pipeline`).

The runtime reports to an observer at four points: around each action, as
``with observer.forward(mb, chunk)``, ``observer.backward(mb, chunk, stash)`` and
``observer.weight_grad(mb, chunk)``, and over its actions, ``for action in
observer.actions(link)`` (each action comes after the batch of messages that brings its
input). :class:`Recorder`, the default, turns these into a :class:`PipelineRun`:

* the compute timeline: one :class:`engine.observe.trace.TraceEvent` per action, on a clock
  shared by the ranks (CUDA events on a GPU: execution, not launch, times);
* the spans spent posting and waiting for batches of messages (lane ``p2p``);
* the bytes held for backward, by :class:`engine.pp.stage_memory.StageMemory`: after F what
  autograd keeps (:class:`engine.observe.memory.ActivationTracker`, the parameters left out),
  after B in a split backward the inputs and output gradients W needs (Qi et al., "Zero
  Bubble Pipeline Parallelism", ICLR 2024), after W nothing.

:func:`measured_bubble`, :func:`measured_idle` and :func:`stage_times` read the timeline.
"""

from __future__ import annotations

import statistics
from contextlib import contextmanager
from dataclasses import dataclass, field

from engine.observe.memory import ActivationTracker
from engine.observe.trace import Clock, TraceEvent
from engine.pp.stage_memory import StageMemory


@dataclass
class PipelineRun:
    """What one rank saw: ``loss`` (the last stage's mean loss, else None), ``events``
    (compute timeline), ``peak_activation_bytes``: the most bytes held at once for backward
    (activations until B; in a schedule with W, then the inputs and output gradients W needs),
    ``activation_bytes`` of one micro-batch's forward per chunk, ``peak_in_flight`` micro-batch
    chunks between F and B; with W also ``weight_stash_bytes`` (per chunk, what one micro-batch
    holds between B and W), ``peak_grad_stash_bytes`` (the most output-gradient bytes held for
    W at once) and ``peak_held`` (micro-batch chunks between F and W). ``p2p_log``: the
    point-to-point batches posted and waited on (:attr:`engine.pp.link.Link.log`).
    ``p2p_events``: the spans this rank spent in those batches (posting and waiting, lane
    ``p2p``), kept apart from ``events`` so the idle share still counts them as idle."""

    loss: float | None
    events: list[TraceEvent] = field(default_factory=list)
    peak_activation_bytes: int = 0
    activation_bytes: dict[int, int] = field(default_factory=dict)
    peak_in_flight: int = 0
    weight_stash_bytes: dict[int, int] = field(default_factory=dict)
    peak_grad_stash_bytes: int = 0
    peak_held: int = 0
    p2p_log: list = field(default_factory=list)
    p2p_events: list[TraceEvent] = field(default_factory=list)


class Recorder:
    """The default observer (module docstring) of pipeline rank ``stage`` running ``chunks``
    (their parameters are not counted as activations)."""

    def __init__(self, stage: int, chunks):
        self.stage = stage
        self.params = [q for c in chunks for q in c.parameters()]
        self.clock = Clock(self.params[0].device)
        self.memory = StageMemory()
        self.marks: list[tuple] = []  # (kind, mb, chunk, start mark, end mark)
        self.rounds: list[tuple] = []  # (start mark, end mark) of each wait for messages

    def actions(self, link):
        """``link.actions()``; each span spent getting the next action in which a batch of
        sends and receives was posted and waited on is kept as two clock marks."""
        iterator = link.actions()
        while True:
            start, logged = self.clock.mark(), len(link.log)
            item = next(iterator, None)
            if len(link.log) != logged:
                self.rounds.append((start, self.clock.mark()))
            if item is None:
                return
            yield item

    @contextmanager
    def _timed(self, kind: str, mb: int, chunk: int):
        start = self.clock.mark()
        yield
        self.marks.append((kind, mb, chunk, start, self.clock.mark()))

    @contextmanager
    def forward(self, mb: int, chunk: int):
        """F: timed, and what autograd keeps for its backward counted."""
        with self._timed("F", mb, chunk), ActivationTracker(exclude=self.params) as acts:
            yield
        self.memory.forward(mb, chunk, acts.bytes)

    @contextmanager
    def backward(self, mb: int, chunk: int, stash):
        """B: timed; its activations freed, ``stash`` (what W needs; None: a full backward)
        held instead."""
        with self._timed("B", mb, chunk):
            yield
        self.memory.backward(mb, chunk, stash)

    @contextmanager
    def weight_grad(self, mb: int, chunk: int):
        """W: timed; what its B kept for it freed."""
        with self._timed("W", mb, chunk):
            yield
        self.memory.weight_grad(mb, chunk)

    def result(self, loss: float | None, p2p_log: list) -> PipelineRun:
        """The run as seen, its clock marks read as seconds once the run is over."""
        seconds = self.clock.seconds
        events = [TraceEvent(f"{kind}{mb}", self.stage, seconds(start), seconds(end),
                             lane="compute", args={"kind": kind, "mb": mb, "chunk": c})
                  for kind, mb, c, start, end in self.marks]
        p2p = [TraceEvent("p2p", self.stage, seconds(start), seconds(end), lane="p2p")
               for start, end in self.rounds]
        return PipelineRun(loss, events, p2p_log=p2p_log, p2p_events=p2p,
                           **self.memory.counts())


def measured_idle(events: list[TraceEvent]) -> dict[int, float]:
    """Idle share of each stage between the run's first start and last end (shared clock)."""
    start = min(e.start for e in events)
    span = max(e.end for e in events) - start
    busy: dict[int, float] = {}
    for e in events:
        busy[e.rank] = busy.get(e.rank, 0.0) + e.end - e.start
    return {stage: 1 - b / span for stage, b in sorted(busy.items())}


def stage_times(events: list[TraceEvent], chunks: int = 1) -> dict[str, list[float]]:
    """Median seconds of each kind of action (``F``, ``B``, ``W``) per stage, times
    ``chunks`` (so they are a whole stage's, as :func:`engine.pp.simulate` takes them)."""
    stages = sorted({e.rank for e in events})
    out: dict[str, list[float]] = {}
    for kind in "FBW":
        per_stage = [[e.end - e.start for e in events if e.rank == s and e.args["kind"] == kind]
                     for s in stages]
        if all(per_stage):
            out[kind] = [statistics.median(t) * chunks for t in per_stage]
    return out


def measured_bubble(events: list[TraceEvent], p: int) -> float:
    """Idle share of ``p`` ranks over the run, from their compute events (shared clock)."""
    start = min(e.start for e in events)
    end = max(e.end for e in events)
    busy = sum(e.end - e.start for e in events)
    return 1 - busy / (p * (end - start))
