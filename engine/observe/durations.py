"""How a meter event's start and end were obtained, and NCCL's own timing of its work.

Each :class:`engine.observe.meter.CommEvent` says in ``timed_by`` where its duration came from:

* ``"nccl"`` (:data:`NCCL`): ProcessGroupNCCL's own CUDA events, recorded on its
  communication stream around the op (``Work._get_duration()``, milliseconds). PyTorch records
  the start events only when ``TORCH_NCCL_ENABLE_TIMING=1`` is set before the process group
  is created, which :func:`engine.launch.backend.init_process_group` does for NCCL groups
  (PyTorch's ``ProcessGroupNCCL.hpp`` notes its cost: one more event per collective, and the
  watchdog's event queries). This is the time the transfer itself took, whatever ran around
  it. A counted collective (a ring of point-to-point batches, each waited on before the next)
  gets the sum of its batches' durations.
* ``"cuda-events (compute stream)"`` (:data:`CUDA_EVENTS`): CUDA events recorded on the
  current (compute) stream at issue and after ``wait()`` (:mod:`engine.observe.clock`). The fallback
  for a collective on CUDA tensors whose work cannot time itself (Gloo with CUDA tensors, or
  NCCL with the variable unset): an async op's span then includes whatever compute ran on the
  stream between the issue and the wait.
* ``"host clock"`` (:data:`HOST`): ``time.perf_counter`` around the call: right for CPU
  tensors (Gloo runs the op on the calling thread or waits for it), only the enqueue time for
  a point-to-point op on CUDA that NCCL did not time.

Nothing is read inside a step: the works are kept on their events and asked for their
durations when the meter closes (:func:`resolve`), after one ``synchronize`` per device,
so timing adds no host synchronisation between ops. The price: an NCCL work holds its tensors,
so what an op sent or received on CUDA stays allocated until the meter closes (the trainer
meters only its untimed warm-up step, before the memory peak is reset: engine.train.timed_steps).

An event NCCL timed starts when it was issued (on the stream for a collective, on the host for
a point-to-point op) or when the previous op NCCL timed on the same group (and peer) ended,
whichever is later (a communicator's stream runs its ops one after another), and ends its
duration later.
"""

from __future__ import annotations

from engine.observe.clock import Clock

NCCL = "nccl"
CUDA_EVENTS = "cuda-events (compute stream)"
HOST = "host clock"
TIMED_BY = (NCCL, CUDA_EVENTS, HOST)


def attach(events, work, device) -> None:
    """Keep ``work`` (an op on ``device``) on ``events``, to be asked its duration when the
    meter closes."""
    for event in events:
        event.works.append((device, work))


def distinct_works(parts) -> list:
    """The ``(device, work)`` of a counted collective's messages, each work once (a batch's
    messages share one work on NCCL); empty when any message has none (it cannot be timed by
    its works)."""
    works, seen = [], set()
    for part in parts:
        if not part.works:
            return []
        for device, work in part.works:
            if id(work) not in seen:
                seen.add(id(work))
                works.append((device, work))
    return works


def duration_ms(works) -> float | None:
    """The summed ``_get_duration()`` of ``works`` in ms, or None when one cannot tell (not
    NCCL, timing not enabled, the op not complete)."""
    total = 0.0
    for _, work in works:
        try:
            total += float(work._get_duration())
        except (RuntimeError, AttributeError):  # "This Backend doesn't support getDuration"
            return None
    return total


def resolve(events, clocks) -> None:
    """Give ``events`` their start and end (see the module docstring) and say how in
    ``timed_by``. ``clocks``: device -> :class:`engine.observe.clock.Clock` of the marks."""
    with_works = [e for e in events if e.works]
    for device in {device for e in with_works for device, _ in e.works}:
        if device not in clocks:
            clocks[device] = Clock(device)
        clocks[device].synchronize()  # once per device: every NCCL end event has fired
    for event in events:
        if len(event.gpu_marks) == 2 or (event.gpu_marks and event.works):
            times = [clocks[device].seconds(mark) for device, mark in event.gpu_marks]
            event.start = times[0]  # issued on the stream
            if len(times) == 2:
                event.end, event.timed_by, event.gpu_marks = times[1], CUDA_EVENTS, []
    last: dict = {}  # (group, peer) -> (its works' ids, start, end) of the last NCCL-timed op
    for event in with_works:
        works, event.works = event.works, []
        ms = duration_ms(works)
        if ms is None:
            continue
        ids = tuple(id(w) for _, w in works)
        key = (event.group, event.peer if event.algorithm == "p2p" else None)
        before = last.get(key)
        if before is not None and before[0] == ids:  # the same work (one NCCL batch)
            event.start, event.end = before[1], before[2]
        else:
            start = max(event.start, before[2]) if before is not None else event.start
            event.start, event.end = start, start + ms / 1e3
            last[key] = (ids, event.start, event.end)
        event.timed_by, event.gpu_marks = NCCL, []
