"""Redundant experts: the busiest experts copied onto spare slots, their tokens split between
the copies, and the per-GPU load that results.

At inference the router is fixed and no balancing loss or bias moves it: some experts stay
hot. DeepSeek-V3 (section 3.4, "Inference and deployment") deploys **redundant experts**: from
the load statistics gathered while serving, the most loaded experts are duplicated onto extra
slots of the GPUs, the experts are rearranged among the GPUs to even the load, and the plan is
recomputed periodically (its prefilling stage: 32 redundant experts over 32 GPUs, each GPU 8
experts + 1 redundant). In training the same imbalance is fought by the bias instead
(:mod:`engine.moe.balance`).

The placement here, all integers (one token-assignment is one unit of load):

1. ``static``: expert ``e`` on GPU ``e // (E / G)``, the training layout
   (:class:`engine.moe.MoE`): no statistics used.
2. **Rearranged** (``redundant = 0``): longest-processing-time packing, the heaviest expert
   first onto the least loaded GPU with a free slot (Graham 1969), ``ceil(E / G)`` experts
   per GPU; the other slots are the redundant ones.
3. Each of the ``redundant`` copies, one at a time: the busiest GPU's heaviest copy is
   (or the next, busiest GPU first, that some GPU can take) duplicated onto the least loaded GPU
   with a free slot that does not hold that expert yet,
   and the expert's tokens on the busy GPU are split between the two copies as evenly as the
   two GPUs' loads allow (``x = min(t, (L_busy - L_idle) // 2)`` tokens move). Tokens are
   conserved and no GPU ends above the busiest one before the copy, so a copy never raises the
   maximum (the dispatcher sending each token to the less busy copy realises the split).

:func:`gpu_loads` returns each GPU's load; the imbalance is ``max / mean`` (MaxVio, Wang et
al. 2024, is that minus 1: :func:`engine.theory.max_violation`).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.validation import positive_int


@dataclass
class Placement:
    """Which expert copies each GPU holds and the tokens each copy processes."""

    copies: list[list[tuple[int, int]]]  # per GPU: (expert, tokens) for each copy it holds
    slots: int  # slots per GPU

    @property
    def loads(self) -> list[int]:
        """Tokens each GPU processes."""
        return [sum(t for _, t in gpu) for gpu in self.copies]

    @property
    def imbalance(self) -> float:
        """The busiest GPU's load over the mean (1 is perfect balance)."""
        loads = self.loads
        return max(loads) / (sum(loads) / len(loads))

    def expert_tokens(self, num_experts: int) -> list[int]:
        """Tokens each expert processes, summed over its copies."""
        total = [0] * num_experts
        for gpu in self.copies:
            for expert, tokens in gpu:
                total[expert] += tokens
        return total


def _check(load, gpus: int, slots: int, redundant: int) -> list[int]:
    load = [int(x) for x in load]
    positive_int("gpus", gpus)
    positive_int("slots", slots)
    if redundant < 0:
        raise ValueError(f"redundant must be 0 or more copies, got {redundant!r}")
    if any(x < 0 for x in load):
        raise ValueError(f"expert loads must be token counts (>= 0), got {load}")
    if len(load) + redundant > gpus * slots:
        raise ValueError(f"{len(load)} experts + {redundant} redundant copies do not fit in "
                         f"{gpus} GPUs x {slots} slots = {gpus * slots}")
    return load


def static_placement(load, gpus: int) -> Placement:
    """The training layout: expert ``e`` on GPU ``e // (E / G)``, no statistics used."""
    load = _check(load, gpus, max(1, -(-len(load) // gpus)), 0)
    if len(load) % gpus:
        raise ValueError(f"{gpus} GPUs do not divide the {len(load)} experts")
    per = len(load) // gpus
    return Placement([[(e, load[e]) for e in range(g * per, (g + 1) * per)]
                      for g in range(gpus)], per)


def place_experts(load, gpus: int, slots: int, redundant: int = 0) -> Placement:
    """Experts of per-expert ``load`` (tokens routed to each) on ``gpus`` GPUs of ``slots``
    slots each, rearranged from the load, with ``redundant`` extra copies of the hottest
    (see the module docstring). Needs ``E + redundant <= gpus * slots``."""
    load = _check(load, gpus, slots, redundant)
    copies: list[list[tuple[int, int]]] = [[] for _ in range(gpus)]

    def gpu_load(g: int) -> int:
        return sum(t for _, t in copies[g])

    base = -(-len(load) // gpus)  # every GPU the same number of experts, as in training
    for expert in sorted(range(len(load)), key=lambda e: (-load[e], e)):
        free = [g for g in range(gpus) if len(copies[g]) < base]
        target = min(free, key=lambda g: (gpu_load(g), g))
        copies[target].append((expert, load[expert]))
    for _ in range(redundant):
        busy, index, free = _next_copy(copies, slots, gpu_load)
        expert, tokens = copies[busy][index]
        idle = min(free, key=lambda g: (gpu_load(g), g))
        moved = max(0, min(tokens, (gpu_load(busy) - gpu_load(idle)) // 2))
        copies[busy][index] = (expert, tokens - moved)
        copies[idle].append((expert, moved))
    return Placement(copies, slots)


def _next_copy(copies, slots: int, gpu_load):
    """(GPU, copy index, GPUs that can take a copy of it): the heaviest copy of the busiest
    GPU that some GPU with a free slot does not hold yet, else of the next busiest."""
    for busy in sorted(range(len(copies)), key=lambda g: (-gpu_load(g), g)):
        for index in sorted(range(len(copies[busy])), key=lambda i: (-copies[busy][i][1], i)):
            expert = copies[busy][index][0]
            free = [g for g in range(len(copies)) if len(copies[g]) < slots
                    and all(e != expert for e, _ in copies[g])]
            if free:
                return busy, index, free
    raise ValueError(f"no GPU has a free slot for a copy of an expert it does not hold: give "
                     f"more than {slots} slots per GPU or fewer redundant copies")


def gpu_loads(load, gpus: int, slots: int, redundant: int = 0) -> list[int]:
    """Tokens each GPU processes under :func:`place_experts`."""
    return place_experts(load, gpus, slots, redundant).loads


def imbalance_floor(share: float, gpus: int, copies: int = 1) -> float:
    """The busiest GPU's load over the mean can be no lower than this, from one expert alone:
    an expert taking ``share`` of the assignments, its tokens split over ``copies`` copies on
    different GPUs, puts ``share / copies`` of all tokens on some GPU, whose fair part is
    ``1 / gpus``: ``max(1, share * gpus / copies)``."""
    positive_int("gpus", gpus)
    positive_int("copies", copies)
    if not 0 <= share <= 1:
        raise ValueError(f"share must be a fraction of the assignments in [0, 1], got {share!r}")
    return max(1.0, share * gpus / copies)


def redundancy_table(load, gpus: int, redundant=(0, 1, 2, 4)) -> list[dict]:
    """One row per placement: the static training layout, then the rearranged one with each
    number of ``redundant`` copies (``E/G + ceil(R/G)`` slots per GPU); each row its GPU loads,
    max / mean and MaxVio."""
    load = [int(x) for x in load]
    rows = [("static", static_placement(load, gpus))]
    per = -(-len(load) // gpus)
    rows += [(r, place_experts(load, gpus, per + -(-r // gpus), r)) for r in redundant]
    return [dict(redundant=r, loads=p.loads, imbalance=p.imbalance,
                 max_vio=p.imbalance - 1) for r, p in rows]
