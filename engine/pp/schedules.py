"""Pipeline schedules as plain data, a validator, and an event simulator.

A schedule is ``{stage: [Action, ...]}`` (:mod:`engine.pp.actions`): the order in which each
pipeline rank runs forwards ``F``, backwards ``B`` and, in zero-bubble schedules
(:mod:`engine.pp.zero_bubble`), weight gradients ``W``. With ``v`` chunks per rank, chunk ``c``
on rank ``s`` is *virtual stage* ``c * p + s`` (Narayanan et al., "Efficient large-scale
language model training on GPU clusters using Megatron-LM", SC 2021, section 2.2), or, with
``placement="v"``, the V shape of :func:`engine.pp.actions.virtual_stage`.

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

from engine.pp.actions import (KINDS, PLACEMENTS, Action, actions_of, as_action, rank_of, shape,
                               splits_backward, virtual_stage)
from engine.validation import non_negative_number, one_of, positive_int, positive_number

__all__ = ["Action", "as_action", "check_sizes", "gpipe", "one_f_one_b", "interleaved_1f1b",
           "validate", "simulate", "SimResult"]


def check_sizes(p, m, v=1):
    """Raise ValueError naming the bad value unless ``p`` (stages), ``m`` (micro-batches) and
    ``v`` (chunks per rank) are positive integers: the first check of every schedule
    generator, here and in :mod:`engine.pp.zero_bubble`."""
    positive_int("p (stages)", p)
    positive_int("m (micro-batches)", m)
    positive_int("v (chunks)", v)


def gpipe(p: int, m: int) -> dict[int, list[Action]]:
    """All ``m`` forwards, then all ``m`` backwards, on every stage (micro-batch order, as
    ``torch.distributed.pipelining.ScheduleGPipe``)."""
    check_sizes(p, m)
    return {s: [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
            for s in range(p)}


def one_f_one_b(p: int, m: int) -> dict[int, list[Action]]:
    """1F1B: ``min(p - s - 1, m)`` warm-up forwards, then one forward and one backward in
    turn, then the remaining backwards."""
    check_sizes(p, m)
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
    check_sizes(p, m, v)
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


def validate(schedule: dict[int, list[Action]], blocking_sends: bool = False,
             placement: str = "interleaved") -> None:
    """Raise ``ValueError`` naming the problem unless ``schedule`` is runnable:

    * stages are ``0..p-1``; every stage runs F and B (and W, if the schedule has any) of
      every (micro-batch, chunk) exactly once, each B after its own F and each W after its B;
    * executed in order with *blocking receives*, every cross-stage dependency is met and no
      stage waits forever. Sends are asynchronous (posted, then completed later), as in
      :mod:`engine.pp.runtime` and ``torch.distributed.pipelining``. With
      ``blocking_sends=True`` a send also waits for its receive (a rendezvous), the stricter
      model under which some correct-looking schedules deadlock.

    ``placement`` (``"interleaved"`` or ``"v"``) says which virtual stage each chunk is
    (:func:`engine.pp.actions.virtual_stage`).
    """
    one_of("placement", placement, PLACEMENTS)
    if isinstance(schedule, dict) and sorted(schedule) != list(range(len(schedule))):
        raise ValueError(f"stages must be 0..p-1, got {sorted(schedule)}")
    given = schedule
    schedule = actions_of(schedule)
    p, m, v = shape(schedule)
    kinds = KINDS if splits_backward(schedule) else ("F", "B")
    expected = sorted(Action(kind, mb, c) for kind in kinds for mb in range(m) for c in range(v))
    for s, actions in schedule.items():
        seen = sorted(actions)
        if seen != expected:
            missing = sorted(set(expected) - set(seen))
            extra = [a for a in seen if seen.count(a) > 1 or a not in expected]
            raise ValueError(f"stage {s} must run {', '.join(kinds[:-1])} and {kinds[-1]} of "
                             f"every micro-batch once: missing {missing[:4]}, repeated or "
                             f"unknown {sorted(set(extra))[:4]}")
        done = set()
        for raw, a in zip(given[s], actions):
            before = {"B": "F", "W": "B"}.get(a.kind)
            if before and (before, a.mb, a.chunk) not in done:
                raise ValueError(f"stage {s} runs {raw} before its "
                                 f"{'forward' if before == 'F' else 'B'}")
            done.add(a)
    stuck = _run_blocking(schedule, p, v, blocking_sends, placement)
    if stuck:
        hint = ""
        if placement == "interleaved" and v > 1 and \
                not _run_blocking(schedule, p, v, blocking_sends, "v"):
            hint = " (it runs with placement='v': rank 0 holding the first and last stage)"
        raise ValueError(f"deadlock: stages wait forever at {stuck}{hint}")


def needs(action: Action, vs: int, last: int):
    """The message ``action`` on virtual stage ``vs`` waits for (None: none)."""
    if action.kind == "F":
        return None if vs == 0 else ("act", action.mb, vs - 1)
    if action.kind == "B":
        return None if vs == last else ("grad", action.mb, vs + 1)
    return None  # W: this stage's own B, checked by the order


def produces(action: Action, vs: int, last: int):
    """The message ``action`` on virtual stage ``vs`` sends (None: none)."""
    if action.kind == "F":
        return None if vs == last else ("act", action.mb, vs)
    if action.kind == "B":
        return None if vs == 0 else ("grad", action.mb, vs)
    return None


def messages(schedule: dict[int, list[Action]], placement: str = "interleaved"):
    """Every message of ``schedule`` in its sender's order: ``(sender, receiver, message)``
    with ``message = ("act" | "grad", mb, virtual stage that sends)``. Messages a rank sends
    to itself (the middle of a V) are included; the runtime hands those over locally."""
    p, _, v = shape(schedule)
    last = p * v - 1
    out = []
    for s, actions in schedule.items():
        for a in actions:
            msg = produces(a, virtual_stage(s, a.chunk, p, placement), last)
            if msg is not None:
                to = msg[2] + (1 if msg[0] == "act" else -1)
                out.append((s, rank_of(to, p, placement), msg))
    return out


def _run_blocking(schedule, p, v, blocking_sends, placement) -> dict:
    """Execute the orders with blocking receives; the actions the stages are stuck at."""
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
            vs = virtual_stage(s, a.chunk, p, placement)
            need = needs(a, vs, last)
            if need is not None:
                if need not in sent:
                    continue
                received.add(need)
            out = produces(a, vs, last)
            if out is not None:
                sent.add(out)
                to = out[2] + (1 if out[0] == "act" else -1)
                if blocking_sends and rank_of(to, p, placement) != s:
                    pending_send[s] = out
            position[s] += 1
            progress = True
    stuck = {s: schedule[s][position[s]] for s in schedule if position[s] < len(schedule[s])}
    stuck.update({s: ("send", msg) for s, msg in pending_send.items()})
    return stuck


@dataclass
class SimResult:
    """``timeline``: ``[(stage, kind, mb, chunk, start, end)]``; ``total`` time; ``bubble``:
    the idle fraction of ``p * total``; per stage, ``peak_in_flight``: the most micro-batch
    chunks whose forward ran and backward (B) did not yet (activations held for B), and
    ``peak_held``: the most whose forward ran and W did not yet (anything held: activations,
    or the inputs and output gradients a later W needs); without W the two are equal."""

    timeline: list
    total: float
    bubble: float
    peak_in_flight: dict[int, int] = field(default_factory=dict)
    peak_held: dict[int, int] = field(default_factory=dict)

    def bubble_vs_ideal(self) -> float:
        """Idle time relative to the busy (ideal) time, the other common definition."""
        return self.bubble / (1 - self.bubble)

    def idle(self) -> dict[int, float]:
        """Idle time of each stage between the start and the end of the whole run."""
        busy: dict[int, float] = {}
        for stage, _, _, _, start, end in self.timeline:
            busy[stage] = busy.get(stage, 0.0) + end - start
        return {s: self.total - b for s, b in sorted(busy.items())}


def _per_stage(name: str, value, p: int, check) -> list[float]:
    values = list(value) if isinstance(value, (list, tuple)) else [value] * p
    if len(values) != p:
        raise ValueError(f"{name} needs one value per stage ({p}), got {len(values)}")
    return [check(name, x) for x in values]


def simulate(schedule, *, t_f=1.0, t_b=2.0, t_w=0.0, t_comm=0.0,
             placement: str = "interleaved") -> SimResult:
    """Run ``schedule`` on a clock. Times are one stage's, for one micro-batch (a number, or a
    list per stage for imbalanced stages); with ``v`` chunks each chunk takes ``1/v`` of them:

    * ``t_f``: the forward;
    * ``t_b``: the input gradient (B) and ``t_w``: the weight gradient (W). A schedule with W
      actions runs them apart; in one without, each B is the whole backward and takes
      ``t_b + t_w`` (so ``t_w = 0`` gives the usual single backward time ``t_b``);
    * ``t_comm``: the delay of every message between two ranks.

    ``placement``: see :func:`validate`."""
    validate(schedule, placement=placement)
    schedule = actions_of(schedule)
    p, _, v = shape(schedule)
    tf = _per_stage("t_f", t_f, p, positive_number)
    tb = _per_stage("t_b", t_b, p, positive_number)
    tw = _per_stage("t_w", t_w, p, non_negative_number)
    non_negative_number("t_comm", t_comm)
    split = splits_backward(schedule)
    duration = {"F": tf, "B": tb if split else [b + w for b, w in zip(tb, tw)], "W": tw}
    last = p * v - 1
    finished: dict[tuple, float] = {}  # (kind, mb, virtual stage) -> end time
    free = {s: 0.0 for s in schedule}
    position = {s: 0 for s in schedule}
    count = {s: {"F": 0, "B": 0, "W": 0} for s in schedule}
    peak = {s: 0 for s in schedule}
    peak_held = {s: 0 for s in schedule}
    timeline = []
    remaining = sum(len(a) for a in schedule.values())
    while remaining:
        for s, actions in schedule.items():
            while position[s] < len(actions):
                a = actions[position[s]]
                vs = virtual_stage(s, a.chunk, p, placement)
                if a.kind == "F":
                    dep = None if vs == 0 else ("F", a.mb, vs - 1)
                elif a.kind == "B":
                    dep = ("F", a.mb, vs) if vs == last else ("B", a.mb, vs + 1)
                else:
                    dep = ("B", a.mb, vs)
                if dep is not None and dep not in finished:
                    break
                ready = 0.0 if dep is None else finished[dep] + (
                    t_comm if rank_of(dep[2], p, placement) != s else 0.0)
                start = max(free[s], ready)
                end = start + duration[a.kind][s] / v
                finished[(a.kind, a.mb, vs)] = end
                free[s] = end
                n = count[s]
                n[a.kind] += 1
                peak[s] = max(peak[s], n["F"] - n["B"])
                peak_held[s] = max(peak_held[s], n["F"] - (n["W"] if split else n["B"]))
                timeline.append((s, a.kind, a.mb, a.chunk, start, end))
                position[s] += 1
                remaining -= 1
    total = max(end for *_, end in timeline)
    busy = sum(end - start for *_, start, end in timeline)
    return SimResult(timeline, total, 1 - busy / (p * total), peak, peak_held)
