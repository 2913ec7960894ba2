"""Pipeline schedules as plain data, a validator, and an event simulator.

A schedule is ``{stage: [Action, ...]}``: the order in which each pipeline rank runs its
work. An :class:`Action` is ``Action(kind, mb, chunk=0)``: the forward ``"F"`` or backward
``"B"`` of micro-batch ``mb`` on the rank's model chunk ``chunk``. It is a ``NamedTuple``, so
plain tuples ``("F", mb)`` and ``("F", mb, chunk)`` are accepted wherever a schedule is read.
With ``v`` chunks per rank, chunk ``c`` on rank ``s`` is *virtual stage* ``c * p + s``
(Narayanan et al., "Efficient large-scale language model training on GPU clusters using
Megatron-LM", SC 2021, section 2.2).

* :func:`gpipe` (Huang et al., NeurIPS 2019): all forwards, then all backwards. Every stage
  holds the activations of all ``m`` micro-batches at once.
* :func:`one_f_one_b` (PipeDream-Flush, Narayanan et al., 2021): stage ``s`` runs
  ``min(p - s - 1, m)`` warm-up forwards, then alternates one forward and one backward, then
  drains. Same bubble as GPipe; at most ``p - s`` micro-batches in flight.
* :func:`interleaved_1f1b`: ``v`` chunks per rank; the bubble shrinks ``v`` times, for ``v``
  times more point-to-point messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from engine.validation import non_negative_int, one_of, positive_int

KINDS = ("F", "B")


class Action(NamedTuple):
    """One step of a pipeline rank: ``kind`` ``"F"`` (forward) or ``"B"`` (backward) of
    micro-batch ``mb`` on this rank's model chunk ``chunk``. Shown as ``F3`` (chunk 0) or
    ``F3c1``."""

    kind: str
    mb: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}{self.mb}" + (f"c{self.chunk}" if self.chunk else "")


def as_action(item) -> Action:
    """``item`` (an :class:`Action` or a tuple ``(kind, mb[, chunk])``) as an :class:`Action`;
    a ``TypeError``/``ValueError`` naming what is wrong otherwise."""
    if isinstance(item, Action):
        action = item
    elif isinstance(item, (tuple, list)) and len(item) in (2, 3):
        action = Action(*item)
    else:
        raise TypeError(f"a pipeline action is (kind, micro-batch[, chunk]), got {item!r}")
    one_of("action kind", action.kind, KINDS)
    non_negative_int(f"micro-batch of {item!r}", action.mb)
    non_negative_int(f"chunk of {item!r}", action.chunk)
    return action


def _check(p, m, v=1):
    positive_int("p (stages)", p)
    positive_int("m (micro-batches)", m)
    positive_int("v (chunks)", v)


def gpipe(p: int, m: int) -> dict[int, list[Action]]:
    """All ``m`` forwards, then all ``m`` backwards, on every stage (micro-batch order, as
    ``torch.distributed.pipelining.ScheduleGPipe``)."""
    _check(p, m)
    return {s: [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
            for s in range(p)}


def one_f_one_b(p: int, m: int) -> dict[int, list[Action]]:
    """1F1B: ``min(p - s - 1, m)`` warm-up forwards, then one forward and one backward in
    turn, then the remaining backwards."""
    _check(p, m)
    schedule = {}
    for s in range(p):
        warmup = min(p - s - 1, m)
        actions = [Action("F", i) for i in range(warmup)]
        forward, backward = warmup, 0
        while forward < m:
            actions += [Action("F", forward), Action("B", backward)]
            forward, backward = forward + 1, backward + 1
        actions += [Action("B", i) for i in range(backward, m)]
        schedule[s] = actions
    return schedule


def interleaved_1f1b(p: int, m: int, v: int) -> dict[int, list[Action]]:
    """Megatron-LM's interleaved 1F1B: each rank runs ``v`` model chunks. Micro-batches go
    through the chunks in groups of ``p``, so ``m`` must be a multiple of ``p``."""
    _check(p, m, v)
    if m % p:
        raise ValueError(f"interleaved 1F1B needs m (micro-batches) to be a multiple of p "
                         f"(stages): got m={m}, p={p}")
    total = m * v

    def forward_id(k):  # the k-th forward of a rank: (micro-batch, chunk)
        return (k // (p * v)) * p + k % p, (k // p) % v

    def backward_id(k):
        return (k // (p * v)) * p + k % p, v - 1 - (k // p) % v

    schedule = {}
    for s in range(p):
        warmup = total if m == p else min((p - s - 1) * 2 + (v - 1) * p, total)
        actions = [Action("F", *forward_id(k)) for k in range(warmup)]
        for i in range(total - warmup):
            actions += [Action("F", *forward_id(warmup + i)), Action("B", *backward_id(i))]
        actions += [Action("B", *backward_id(i)) for i in range(total - warmup, total)]
        schedule[s] = actions
    return schedule


def actions_of(schedule) -> dict[int, list[Action]]:
    """``schedule`` with every action as an :class:`Action` (checked by :func:`as_action`)."""
    if not isinstance(schedule, dict) or not schedule:
        raise TypeError(f"a schedule is a non-empty dict {{stage: [actions]}}, got "
                        f"{type(schedule).__name__}")
    return {s: [as_action(a) for a in acts] for s, acts in schedule.items()}


def _shape(schedule: dict[int, list[Action]]) -> tuple[int, int, int]:
    """(p, m, v) of a schedule of :class:`Action` s."""
    actions = [a for acts in schedule.values() for a in acts]
    if not actions:
        raise ValueError("the schedule has no actions")
    return len(schedule), 1 + max(a.mb for a in actions), 1 + max(a.chunk for a in actions)


def validate(schedule: dict[int, list[Action]], blocking_sends: bool = False) -> None:
    """Raise ``ValueError`` naming the problem unless ``schedule`` is runnable:

    * stages are ``0..p-1``; every stage runs F and B of every (micro-batch, chunk) exactly
      once, and each B after its own F;
    * executed in order with *blocking receives*, every cross-stage dependency is met and no
      stage waits forever. Sends are asynchronous (posted, then completed later), as in
      :mod:`engine.pp.runtime` and ``torch.distributed.pipelining``. With
      ``blocking_sends=True`` a send also waits for its receive (a rendezvous), the stricter
      model under which some correct-looking schedules deadlock.
    """
    if isinstance(schedule, dict) and sorted(schedule) != list(range(len(schedule))):
        raise ValueError(f"stages must be 0..p-1, got {sorted(schedule)}")
    given = schedule
    schedule = actions_of(schedule)
    p, m, v = _shape(schedule)
    expected = sorted((kind, mb, c) for kind in KINDS for mb in range(m) for c in range(v))
    for s, actions in schedule.items():
        seen = sorted(actions)
        if seen != expected:
            missing = sorted(set(expected) - set(seen))
            extra = [a for a in seen if seen.count(a) > 1 or a not in expected]
            raise ValueError(f"stage {s} must run F and B of every micro-batch once: missing "
                             f"{[Action(*a) for a in missing[:4]]}, repeated or unknown "
                             f"{sorted(set(extra))[:4]}")
        done_f = set()
        for raw, a in zip(given[s], actions):
            if a.kind == "F":
                done_f.add((a.mb, a.chunk))
            elif (a.mb, a.chunk) not in done_f:
                raise ValueError(f"stage {s} runs {raw} before its forward")
    _run_blocking(schedule, p, v, blocking_sends)


def _needs(action: Action, vs: int, last: int):
    """The message ``action`` on virtual stage ``vs`` waits for (None: none)."""
    if action.kind == "F":
        return None if vs == 0 else ("act", action.mb, vs - 1)
    return None if vs == last else ("grad", action.mb, vs + 1)


def _produces(action: Action, vs: int, last: int):
    """The message ``action`` on virtual stage ``vs`` sends (None: none)."""
    if action.kind == "F":
        return None if vs == last else ("act", action.mb, vs)
    return None if vs == 0 else ("grad", action.mb, vs)


def _run_blocking(schedule, p, v, blocking_sends):
    """Execute the orders with blocking receives; raise on deadlock."""
    last = p * v - 1
    position = {s: 0 for s in schedule}
    sent: set = set()  # messages posted: ("act" | "grad", mb, virtual stage that sent)
    received: set = set()
    pending_send: dict[int, tuple] = {}  # blocking sends: stage -> message not yet received
    progress = True
    while progress:
        progress = False
        for s, actions in schedule.items():
            if s in pending_send:
                if pending_send[s] in received:
                    del pending_send[s]
                    progress = True
                continue
            if position[s] == len(actions):
                continue
            a = actions[position[s]]
            vs = a.chunk * p + s
            need = _needs(a, vs, last)
            if need is not None:
                if need not in sent:
                    continue
                received.add(need)
            out = _produces(a, vs, last)
            if out is not None:
                sent.add(out)
                if blocking_sends:
                    pending_send[s] = out
            position[s] += 1
            progress = True
    stuck = {s: schedule[s][position[s]] for s in schedule if position[s] < len(schedule[s])}
    stuck.update({s: ("send", msg) for s, msg in pending_send.items()})
    if stuck:
        raise ValueError(f"deadlock: stages wait forever at {stuck}")


@dataclass
class SimResult:
    """``timeline``: ``[(stage, kind, mb, chunk, start, end)]``; ``total`` time; ``bubble``:
    the idle fraction of ``p * total``; ``peak_in_flight``: per stage, the most micro-batches
    whose forward ran and backward did not yet (activations held)."""

    timeline: list
    total: float
    bubble: float
    peak_in_flight: dict[int, int] = field(default_factory=dict)

    def bubble_vs_ideal(self) -> float:
        """Idle time relative to the busy (ideal) time, the other common definition."""
        return self.bubble / (1 - self.bubble)


def simulate(schedule, *, t_f=1.0, t_b=2.0, t_comm=0.0) -> SimResult:
    """Run ``schedule`` on a clock. ``t_f`` and ``t_b`` are one stage's forward and backward
    times for one micro-batch (a number, or a list per stage for imbalanced stages); with
    ``v`` chunks each chunk takes ``1/v`` of them. ``t_comm`` delays every cross-stage
    message."""
    validate(schedule)
    schedule = actions_of(schedule)
    p, _, v = _shape(schedule)
    tf = list(t_f) if isinstance(t_f, (list, tuple)) else [t_f] * p
    tb = list(t_b) if isinstance(t_b, (list, tuple)) else [t_b] * p
    if len(tf) != p or len(tb) != p:
        raise ValueError(f"t_f and t_b need one value per stage ({p}), got {len(tf)} and "
                         f"{len(tb)}")
    last = p * v - 1
    finished: dict[tuple, float] = {}  # (kind, mb, virtual stage) -> end time
    free = {s: 0.0 for s in schedule}
    position = {s: 0 for s in schedule}
    in_flight = {s: 0 for s in schedule}
    peak = {s: 0 for s in schedule}
    timeline = []
    remaining = sum(len(a) for a in schedule.values())
    while remaining:
        for s, actions in schedule.items():
            while position[s] < len(actions):
                a = actions[position[s]]
                vs = a.chunk * p + s
                if a.kind == "F":
                    dep = None if vs == 0 else ("F", a.mb, vs - 1)
                else:
                    dep = ("F", a.mb, vs) if vs == last else ("B", a.mb, vs + 1)
                if dep is not None and dep not in finished:
                    break
                ready = 0.0 if dep is None else finished[dep] + (
                    t_comm if dep[2] != vs else 0.0)
                start = max(free[s], ready)
                end = start + (tf[s] if a.kind == "F" else tb[s]) / v
                finished[(a.kind, a.mb, vs)] = end
                free[s] = end
                in_flight[s] += 1 if a.kind == "F" else -1
                peak[s] = max(peak[s], in_flight[s])
                timeline.append((s, a.kind, a.mb, a.chunk, start, end))
                position[s] += 1
                remaining -= 1
    total = max(end for *_, end in timeline)
    busy = sum(end - start for *_, start, end in timeline)
    return SimResult(timeline, total, 1 - busy / (p * total), peak)
