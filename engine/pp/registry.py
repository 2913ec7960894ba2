"""The engine's pipeline schedules by name: the one table the trainer, the measurements, the
PyTorch reference orders, the explorer and the grader all read.

Each entry says what it takes to run a schedule:

* ``make``: the generator of :mod:`engine.pp.schedules` or :mod:`engine.pp.zero_bubble`,
  called ``make(p, m)``, or ``make(p, m, v)`` when the caller picks the chunks per rank;
* ``placement``: where the chunks live (:func:`engine.pp.actions.virtual_stage`):
  ``"interleaved"`` (chunk ``c`` of rank ``s`` is virtual stage ``c * p + s``, the loop of
  Megatron-LM) or ``"v"`` (the V of ZB-V and DualPipeV: rank 0 holds stages 0 and ``2p-1``);
* ``chunks``: model chunks per rank, or ``None`` when the caller gives it (``v``);
* ``label``: the name the explorer and the chapter print;
* ``torch_class``: the class of ``torch.distributed.pipelining.schedules`` that builds the
  same order (:mod:`engine.pp.reference`), where there is one.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

from engine.pp.actions import Action
from engine.pp.schedules import gpipe, interleaved_1f1b, one_f_one_b
from engine.pp.zero_bubble import dualpipe_v, zb_h1, zb_h2, zb_v


class Schedule(NamedTuple):
    """One registered schedule (see the module docstring for the fields). A tuple whose first
    item is the generator, so ``SCHEDULES[name][0](p, m)`` builds it."""
    make: Callable[..., dict[int, list[Action]]]
    placement: str
    chunks: Optional[int]
    label: str
    torch_class: Optional[str] = None


SCHEDULES: dict[str, Schedule] = {
    "gpipe": Schedule(gpipe, "interleaved", 1, "GPipe"),
    "1f1b": Schedule(one_f_one_b, "interleaved", 1, "1F1B"),
    "interleaved": Schedule(interleaved_1f1b, "interleaved", None, "interleaved 1F1B",
                            "ScheduleInterleaved1F1B"),
    "zb_h1": Schedule(zb_h1, "interleaved", 1, "ZB-H1", "ScheduleInterleavedZeroBubble"),
    "zb_h2": Schedule(zb_h2, "interleaved", 1, "ZB-H2"),
    "zb_v": Schedule(zb_v, "v", 2, "ZB-V", "ScheduleZBVZeroBubble"),
    "dualpipe_v": Schedule(dualpipe_v, "v", 2, "DualPipeV", "ScheduleDualPipeV"),
}


def schedule_spec(name: str, names=None) -> Schedule:
    """The registered :class:`Schedule` called ``name``; ``names`` (default: all of them)
    limits the choice, as a command line whose runtime runs only some does. Raises
    ValueError naming ``name`` and the choices."""
    choices = list(SCHEDULES if names is None else names)
    if name not in choices or name not in SCHEDULES:
        raise ValueError(f"the schedule kind must be one of {', '.join(choices)}; got {name!r}")
    return SCHEDULES[name]


def build_schedule(name: str, p: int, m: int, v: int = 2):
    """``(schedule, placement, chunks per rank)`` of the registered schedule ``name`` for
    ``p`` ranks and ``m`` micro-batches (``v``: chunks per rank where the schedule lets the
    caller choose, the interleaved one; the others have their own)."""
    spec = schedule_spec(name)
    if spec.chunks is None:
        return spec.make(p, m, v), spec.placement, v
    return spec.make(p, m), spec.placement, spec.chunks
