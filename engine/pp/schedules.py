"""Pipeline schedules as plain data, a validator, and an event simulator.

A schedule is ``{stage: [action, ...]}``: the order in which each pipeline rank runs its
work. An action is ``("F", mb)`` or ``("B", mb)`` (forward or backward of micro-batch ``mb``);
interleaved schedules add the model chunk: ``("F", mb, chunk)``. With ``v`` chunks per rank,
chunk ``c`` on rank ``s`` is *virtual stage* ``c * p + s`` (Narayanan et al., "Efficient
large-scale language model training on GPU clusters using Megatron-LM", SC 2021, section 2.2).

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

Action = tuple  # ("F" | "B", micro-batch[, chunk])


def _check(p, m, v=1):
    for name, value in (("p (stages)", p), ("m (micro-batches)", m), ("v (chunks)", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def gpipe(p: int, m: int) -> dict[int, list[Action]]:
    """All ``m`` forwards, then all ``m`` backwards, on every stage (micro-batch order, as
    ``torch.distributed.pipelining.ScheduleGPipe``)."""
    _check(p, m)
    return {s: [("F", i) for i in range(m)] + [("B", i) for i in range(m)] for s in range(p)}


def one_f_one_b(p: int, m: int) -> dict[int, list[Action]]:
    """1F1B: ``min(p - s - 1, m)`` warm-up forwards, then one forward and one backward in
    turn, then the remaining backwards."""
    _check(p, m)
    schedule = {}
    for s in range(p):
        warmup = min(p - s - 1, m)
        actions = [("F", i) for i in range(warmup)]
        forward, backward = warmup, 0
        while forward < m:
            actions += [("F", forward), ("B", backward)]
            forward, backward = forward + 1, backward + 1
        actions += [("B", i) for i in range(backward, m)]
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
        actions = [("F", *forward_id(k)) for k in range(warmup)]
        for i in range(total - warmup):
            actions += [("F", *forward_id(warmup + i)), ("B", *backward_id(i))]
        actions += [("B", *backward_id(i)) for i in range(total - warmup, total)]
        schedule[s] = actions
    return schedule


def _shape(schedule) -> tuple[int, int, int]:
    """(p, m, v) of a schedule."""
    p = len(schedule)
    actions = [a for acts in schedule.values() for a in acts]
    m = 1 + max(a[1] for a in actions)
    v = 1 + max((a[2] if len(a) > 2 else 0) for a in actions)
    return p, m, v


def _virtual(action, stage, p):
    chunk = action[2] if len(action) > 2 else 0
    return chunk * p + stage


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
    if sorted(schedule) != list(range(len(schedule))):
        raise ValueError(f"stages must be 0..p-1, got {sorted(schedule)}")
    p, m, v = _shape(schedule)
    expected = sorted((kind, mb, c) for kind in "BF" for mb in range(m) for c in range(v))
    for s, actions in schedule.items():
        seen = sorted((a[0], a[1], a[2] if len(a) > 2 else 0) for a in actions)
        if seen != expected:
            missing = sorted(set(expected) - set(seen))
            extra = [a for a in seen if seen.count(a) > 1 or a not in expected]
            raise ValueError(f"stage {s} must run F and B of every micro-batch once: missing "
                             f"{missing[:4]}, repeated or unknown {sorted(set(extra))[:4]}")
        done_f = set()
        for a in actions:
            key = (a[1], a[2] if len(a) > 2 else 0)
            if a[0] == "F":
                done_f.add(key)
            elif key not in done_f:
                raise ValueError(f"stage {s} runs {a} before its forward")
    _run_blocking(schedule, p, v, blocking_sends)


def _run_blocking(schedule, p, v, blocking_sends):
    """Execute the orders with blocking receives; raise on deadlock."""
    last = p * v - 1
    position = {s: 0 for s in schedule}
    sent: set = set()  # messages posted: ("act" | "grad", mb, virtual stage that sent)
    received: set = set()

    def needs(s, a):
        vs = _virtual(a, s, p)
        if a[0] == "F":
            return None if vs == 0 else ("act", a[1], vs - 1)
        return None if vs == last else ("grad", a[1], vs + 1)

    def produces(s, a):
        vs = _virtual(a, s, p)
        if a[0] == "F":
            return None if vs == last else ("act", a[1], vs)
        return None if vs == 0 else ("grad", a[1], vs)

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
            need = needs(s, a)
            if need is not None:
                if need not in sent:
                    continue
                received.add(need)
            out = produces(s, a)
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


def simulate(schedule, t_f=1.0, t_b=2.0, t_comm=0.0) -> SimResult:
    """Run ``schedule`` on a clock. ``t_f`` and ``t_b`` are one stage's forward and backward
    times for one micro-batch (a number, or a list per stage for imbalanced stages); with
    ``v`` chunks each chunk takes ``1/v`` of them. ``t_comm`` delays every cross-stage
    message."""
    validate(schedule)
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
                vs, chunk = _virtual(a, s, p), (a[2] if len(a) > 2 else 0)
                if a[0] == "F":
                    dep = None if vs == 0 else ("F", a[1], vs - 1)
                else:
                    dep = ("F", a[1], vs) if vs == last else ("B", a[1], vs + 1)
                if dep is not None and dep not in finished:
                    break
                ready = 0.0 if dep is None else finished[dep] + (
                    t_comm if dep[2] != vs else 0.0)
                start = max(free[s], ready)
                end = start + (tf[s] if a[0] == "F" else tb[s]) / v
                finished[(a[0], a[1], vs)] = end
                free[s] = end
                in_flight[s] += 1 if a[0] == "F" else -1
                peak[s] = max(peak[s], in_flight[s])
                timeline.append((s, a[0], a[1], chunk, start, end))
                position[s] += 1
                remaining -= 1
    total = max(end for *_, end in timeline)
    busy = sum(end - start for *_, start, end in timeline)
    return SimResult(timeline, total, 1 - busy / (p * total), peak)
