"""The training loop every strategy runs: warm-up, timed steps, the bytes sent by group.

:func:`run_steps` runs a :class:`engine.train.strategy.Strategy` for ``warmup + steps`` steps on
every rank, the engine's strategies and PyTorch's alike, and measures what a lab needs:

* **time**: each step starts together on every rank (a one-element all-reduce lines them
  up), and is marked with :class:`engine.observe.trace.Clock`: CUDA events on a GPU, read only after
  the run (each read waits for its event), ``perf_counter`` on the CPU. A step takes as long
  as its slowest rank, so the per-step times are all-reduced with MAX;
* **bytes**: the first step runs under a :class:`engine.observe.meter.CommMeter` that counts
  every collective on the wire (``count="wire"``), split by kind of group by the one
  classifier (:func:`engine.compose.traffic.report_traffic`). The timed steps run without a
  meter, on the built-in collectives;
* **memory**: on a GPU, what is allocated once the model is sharded and the optimizer's state
  exists (read after the first step: AdamW creates its state at its first step), and the
  peak over the timed steps (the peak is reset after the warm-up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.observe.meter import CommMeter
from engine.comm import ops
from engine.pp import PipelineRun
from engine.compose.traffic import report_traffic
from engine.observe.trace import Clock



@dataclass
class StepsRun:
    """What one rank measured. Per timed step: ``step_s`` (the slowest rank's seconds, the
    same on every rank), ``own_step_s`` and ``compute_s`` (this rank's forward and backward).
    ``losses``: every step's, warm-up included (None off the last pipeline stage).
    ``traffic``: bytes this rank sent in one step through each kind of group."""

    step_s: list[float]
    own_step_s: list[float]
    compute_s: list[float]
    losses: list[float | None]
    traffic: dict[str, int]
    last: PipelineRun
    cuda_allocated: int | None = None
    cuda_peak: int | None = None
    counted: bool = True  # False where some bytes were modeled, not counted


def run_steps(strategy, steps: int, warmup: int = 1, first_step: int = 0,
              after_step: Callable[[int, PipelineRun], None] | None = None) -> StepsRun:
    """``warmup`` untimed steps (the first counts the bytes), then ``steps`` timed ones: the
    run's steps ``first_step``, ``first_step + 1``, ... (``strategy.step(k)``).

    ``first_step``: the run's index of this launch's first step, past 0 when the run resumed
    from a checkpoint. Only a run's step 0 counts its bytes on the wire: the counted
    collectives add in another order than the built-in ones (the last bit of an all-reduce
    differs at 4 ranks), and a resumed run must compute exactly what the uninterrupted one
    did, so a resumed launch's first step runs the built-ins under ``count="model"``.
    ``after_step(step, run)`` is called after each step with its index in the run, outside
    the timed span: progress, checkpoints."""
    device = strategy.device
    cuda = device.type == "cuda"
    allocated = None  # read after the first step, once the optimizer's state exists
    clock = Clock(device)
    warm_up_groups(strategy, device)
    marks, computes, losses = [], [], []
    traffic, counted = {}, True
    for i in range(warmup + steps):
        if i == warmup and cuda:
            torch.cuda.reset_peak_memory_stats(device)
        line_up(device)
        start = clock.mark()
        if i == 0:
            with CommMeter(count="wire" if first_step == 0 else "model") as meter:
                run = strategy.step(first_step + i)
            traffic = traffic_of(strategy, meter.events)
            counted = all(e.measured for e in meter.events)
        else:
            run = strategy.step(first_step + i)
        end = clock.mark()
        if i == 0:
            allocated = allocated_memory(device)
        losses.append(run.loss)
        if after_step is not None:
            after_step(first_step + i, run)
        if i >= warmup:
            marks.append((start, end))
            computes.append(sum(e.seconds for e in run.events))
    own = [clock.seconds(end) - clock.seconds(start) for start, end in marks]
    return StepsRun(slowest(own, device), own, computes, losses, traffic, run, allocated,
                    torch.cuda.max_memory_allocated(device) if cuda else None, counted)


def allocated_memory(device: torch.device) -> int | None:
    """Bytes allocated on ``device`` (``torch.cuda.memory_allocated``; None off a GPU)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def line_up(device: torch.device) -> None:
    """Wait for every rank: a one-element all-reduce on the rank's ``device``."""
    ops.all_reduce(torch.zeros(1, device=device))


def warm_up_groups(strategy, device: torch.device) -> None:
    """A one-element built-in all-reduce on every group of the strategy, before the first step.

    NCCL connects a group at its first built-in collective, and the first step, counted on the
    wire, runs none (its collectives are point-to-point rings): without this the first timed
    step would pay for the connections. Every rank takes the kinds in the same order and the
    groups of one kind are disjoint, so the calls cannot wait on each other in a cycle."""
    mesh = strategy.mesh
    for group in (mesh.tp_group, mesh.dp_group, mesh.pp_group, mesh.embedding_group,
                  *strategy.groups.values()):
        if group is not None:
            ops.all_reduce(torch.zeros(1, device=device), group=group)


def slowest(seconds: list[float], device: torch.device) -> list[float]:
    """Per step, the largest of every rank's ``seconds`` (all-reduced on ``device``)."""
    if not seconds:
        return []
    times = torch.tensor(seconds, dtype=torch.float64, device=device)
    ops.all_reduce(times, op=ops.ReduceOp.MAX)
    return times.tolist()


def traffic_of(strategy, events) -> dict[str, int]:
    """Bytes this rank sent in ``events``, per kind of group, under ``engine train``'s names
    (:func:`engine.compose.traffic.report_traffic`: one classifier for every implementation;
    an all-to-all over the ep group is the experts' wherever they are spread)."""
    return report_traffic(events, strategy.mesh, moe=strategy.mesh.ep > 1)
