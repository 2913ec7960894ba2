"""What a pipeline schedule is made of: typed actions, and where each model chunk lives.

A schedule is plain data, ``{stage: [Action, ...]}``: the order in which each pipeline rank
runs its work. An :class:`Action` is ``Action(kind, mb, chunk=0)``:

* ``"F"``: the forward of micro-batch ``mb`` on this rank's model chunk ``chunk``;
* ``"B"``: its backward. In a schedule that also has ``"W"`` actions, ``B`` is only the
  gradient of the chunk's *input*, the one the previous stage waits for;
* ``"W"``: the gradient of the chunk's *weights*, which no other stage waits for, so a
  schedule may run it later to fill idle time (Qi et al., "Zero Bubble Pipeline Parallelism",
  ICLR 2024, section 2). A schedule has a W for every B or for none.

``Action`` is a ``NamedTuple``: plain tuples ``("F", mb)`` and ``("F", mb, chunk)`` are read
as the same thing.

**Placement.** With ``v`` chunks per rank the model is cut into ``p * v`` consecutive
*virtual stages*, and the placement says which rank holds which:

* ``"interleaved"`` (Megatron-LM, Narayanan et al., SC 2021, section 2.2): chunk ``c`` of rank
  ``s`` is virtual stage ``c * p + s``; rank 0 holds 0, p, 2p, ...
* ``"v"`` (the V shape of ZB-V and DualPipeV): even chunks go down the ranks, odd chunks come
  back up, so chunk 1 of rank ``s`` is virtual stage ``2p - 1 - s``: rank 0 holds the first
  *and the last* virtual stage, and the middle hand-over (``p - 1`` to ``p``) stays on rank
  ``p - 1`` without a message.
"""

from __future__ import annotations

from typing import NamedTuple

from engine.validation import non_negative_int, one_of

KINDS = ("F", "B", "W")
PLACEMENTS = ("interleaved", "v")


class Action(NamedTuple):
    """One step of a pipeline rank: ``kind`` ``"F"``, ``"B"`` or ``"W"`` of micro-batch
    ``mb`` on this rank's model chunk ``chunk``. Shown as ``F3`` (chunk 0) or ``F3c1``."""

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


def actions_of(schedule) -> dict[int, list[Action]]:
    """``schedule`` with every action as an :class:`Action` (checked by :func:`as_action`)."""
    if not isinstance(schedule, dict) or not schedule:
        raise TypeError(f"a schedule is a non-empty dict {{stage: [actions]}}, got "
                        f"{type(schedule).__name__}")
    return {s: [as_action(a) for a in acts] for s, acts in schedule.items()}


def shape(schedule: dict[int, list[Action]]) -> tuple[int, int, int]:
    """(p, m, v) of a schedule of :class:`Action` s: stages, micro-batches, chunks per rank."""
    actions = [a for acts in schedule.values() for a in acts]
    if not actions:
        raise ValueError("the schedule has no actions")
    return len(schedule), 1 + max(a.mb for a in actions), 1 + max(a.chunk for a in actions)


def splits_backward(schedule: dict[int, list[Action]]) -> bool:
    """Whether ``schedule`` has W actions (then every B is the input gradient only)."""
    return any(a.kind == "W" for acts in schedule.values() for a in acts)


def virtual_stage(stage: int, chunk: int, p: int, placement: str = "interleaved") -> int:
    """The virtual stage that chunk ``chunk`` of pipeline rank ``stage`` runs."""
    one_of("placement", placement, PLACEMENTS)
    if placement == "v" and chunk % 2:
        return chunk * p + p - 1 - stage
    return chunk * p + stage


def rank_of(vs: int, p: int, placement: str = "interleaved") -> int:
    """The pipeline rank that holds virtual stage ``vs``."""
    one_of("placement", placement, PLACEMENTS)
    if placement == "v" and (vs // p) % 2:
        return p - 1 - vs % p
    return vs % p


def virtual_stages(stage: int, p: int, v: int, placement: str = "interleaved") -> list[int]:
    """The virtual stages rank ``stage`` holds, chunk by chunk: pick its model pieces with
    ``[pieces[i] for i in virtual_stages(stage, p, v, placement)]``."""
    return [virtual_stage(stage, c, p, placement) for c in range(v)]
