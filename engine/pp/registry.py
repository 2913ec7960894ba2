"""The engine's pipeline schedules by name, and a schedule built and checked once per run.

:data:`SCHEDULES` is the one table the trainer, the measurements, the PyTorch reference
orders, the explorer and the grader read, and :func:`schedule_spec` the one place a name is
looked up. Each :class:`Schedule` pairs the generator that writes the order with the
schedule's facts (:data:`engine.theory.schedule_facts.SCHEDULE_FACTS`, kept in the
foundations layer so that the formulas of :mod:`engine.theory` read them too):

* ``make``: the generator of :mod:`engine.pp.schedules` (GPipe, Huang et al. 2019; 1F1B,
  PipeDream-Flush, Narayanan et al. 2021; interleaved 1F1B, Megatron-LM, Narayanan et al.,
  SC 2021) or of :mod:`engine.pp.zero_bubble` (Qi et al., "Zero Bubble Pipeline
  Parallelism", ICLR 2024; DualPipeV), called ``make(p, m)``, or ``make(p, m, v)`` where the
  caller picks the chunks per rank (``takes_chunks``: the interleaved one);
* ``placement``, ``chunks`` (per rank; the default where the caller picks), ``label``,
  ``torch_class`` and ``peak``: see :class:`engine.theory.schedule_facts.ScheduleFacts`.

:func:`build_schedule` gives a :class:`PipelineSchedule`: the order, validated once (every
action once, no deadlock) and planned once into each rank's batches of messages
(:func:`engine.pp.link.plan_rounds`), which :func:`engine.pp.run_pipeline` then runs at
every step without checking it again.
"""

from __future__ import annotations

from functools import cached_property
from typing import Callable, NamedTuple, Optional

from engine.pp.actions import Action, actions_of, rank_of, shape, splits_backward
from engine.pp.link import plan_rounds
from engine.pp.schedules import gpipe, interleaved_1f1b, one_f_one_b, validate
from engine.pp.zero_bubble import dualpipe_v, zb_h1, zb_h2, zb_v
from engine.theory.schedule_facts import SCHEDULE_FACTS, Peak


class Schedule(NamedTuple):
    """One registered schedule (see the module docstring for the fields). A tuple whose first
    item is the generator, so ``SCHEDULES[name][0](p, m)`` builds it."""
    make: Callable[..., dict[int, list[Action]]]
    placement: str
    chunks: int
    label: str
    torch_class: Optional[str] = None
    takes_chunks: bool = False
    peak: Optional[Peak] = None


SCHEDULES: dict[str, Schedule] = {
    name: Schedule(make, *SCHEDULE_FACTS[name])
    for name, make in (("gpipe", gpipe), ("1f1b", one_f_one_b), ("interleaved", interleaved_1f1b),
                       ("zb_h1", zb_h1), ("zb_h2", zb_h2), ("zb_v", zb_v),
                       ("dualpipe_v", dualpipe_v))}


def schedule_spec(name: str, names=None) -> Schedule:
    """The registered :class:`Schedule` called ``name``; ``names`` (default: all of them)
    limits the choice, as a command line whose runtime runs only some does. Raises
    ValueError naming ``name`` and the choices."""
    choices = list(SCHEDULES if names is None else names)
    if name not in choices or name not in SCHEDULES:
        raise ValueError(f"the schedule kind must be one of {', '.join(choices)}; got {name!r}")
    return SCHEDULES[name]


class PipelineSchedule:
    """A schedule ready to run at every step, checked once: ``actions`` (``{stage:
    [Action]}``, :func:`engine.pp.schedules.validate` passed), its ``placement`` and ``name``
    (None for a hand-written one); ``p``, ``m``, ``v`` (stages, micro-batches, chunks per
    rank), ``split`` (whether it has W actions), ``loss_stage`` (the rank of the last
    virtual stage) and ``rounds`` (each rank's program of message batches and actions,
    :func:`engine.pp.link.plan_rounds`, planned on first use) follow from them."""

    def __init__(self, actions, placement: str = "interleaved", name: str | None = None):
        validate(actions, placement=placement)  # a schedule that would deadlock: an error here
        self.actions = actions_of(actions)
        self.placement, self.name = placement, name
        self.p, self.m, self.v = shape(self.actions)
        self.split = splits_backward(self.actions)
        self.loss_stage = rank_of(self.p * self.v - 1, self.p, placement)

    @cached_property
    def rounds(self) -> dict[int, list]:
        return plan_rounds(self.actions, self.placement)

    def __repr__(self) -> str:
        return (f"PipelineSchedule({self.name or 'custom'}, p={self.p}, m={self.m}, "
                f"v={self.v}, placement={self.placement!r})")


def build_schedule(name: str, p: int, m: int, v: int | None = None) -> PipelineSchedule:
    """The registered schedule ``name`` for ``p`` ranks and ``m`` micro-batches, built and
    checked once (``v``: chunks per rank where the schedule lets the caller choose, the
    interleaved one, its registered default otherwise; the others have their own)."""
    spec = schedule_spec(name)
    if spec.takes_chunks:
        actions = spec.make(p, m, spec.chunks if v is None else v)
    else:
        actions = spec.make(p, m)
    return PipelineSchedule(actions, spec.placement, name)
