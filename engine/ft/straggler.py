"""Finding a straggler: every rank's step time, gathered each step, against the median.

In synchronous training the slowest rank sets the step time of all (each collective waits for
it), so one slow GPU, a throttled node or a bad link slows the whole job; at scale it is a
daily event (Wu et al., "FALCON: pinpointing and mitigating stragglers for large-scale
hybrid-parallel training", 2024; Meta's Llama 3 report, 2024, section 3.3.4, on the tooling
that finds them). The detector here is the simple, robust form: each step every rank's time is
gathered (:func:`gather_step_times`, one all-gather of one number per rank), each time is
divided by the step's median over the ranks, and a rank is named once its ratio has stayed
above ``ratio`` for ``patience`` steps in a row. The median ignores one slow rank (it takes
half the ranks to move it), and ``patience`` ignores the one-step spikes that every real
machine has (a garbage collection, a page fault, a noisy neighbour).
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from engine.comm import ops
from engine.launch.device import rank_device
from engine.validation import positive_int, positive_number


def gather_step_times(seconds: float, group=None) -> list[float]:
    """Every rank's ``seconds`` (this step's time), in group rank order."""
    n, device = dist.get_world_size(group), rank_device()  # NCCL moves only the rank's GPU's
    mine = torch.tensor([float(seconds)], dtype=torch.float64, device=device)
    everyone = torch.empty(n, dtype=torch.float64, device=device)
    ops.all_gather_into_tensor(everyone, mine, group=group)
    return everyone.tolist()


class StragglerDetector:
    """``named = detector.observe(times)`` once per step, with every rank's step time.

    Args:
        world_size: the ranks observed.
        ratio: a rank is slow in a step when its time exceeds ``ratio`` x the median.
        patience: the consecutive slow steps that name it.

    ``named``: the ranks named so far, with the step that named them (``steps_to_name``).
    """

    def __init__(self, world_size: int, ratio: float = 1.5, patience: int = 3):
        self.world_size = positive_int("world_size", world_size)
        self.ratio = positive_number("ratio", ratio)
        if ratio <= 1:
            raise ValueError(f"ratio must be above 1 (a multiple of the median), got {ratio!r}")
        self.patience = positive_int("patience", patience)
        self.streak = [0] * world_size
        self.steps = 0
        self.named: dict[int, int] = {}  # rank -> the step (1-based) that named it

    def observe(self, times) -> list[int]:
        """Take one step's times (one per rank); return the ranks named at this step."""
        times = [float(t) for t in times]
        if len(times) != self.world_size:
            raise ValueError(f"expected {self.world_size} step times, got {len(times)}")
        self.steps += 1
        median = statistics.median(times)
        new = []
        for rank, t in enumerate(times):
            self.streak[rank] = self.streak[rank] + 1 if t > self.ratio * median else 0
            if self.streak[rank] >= self.patience and rank not in self.named:
                self.named[rank] = self.steps
                new.append(rank)
        return new
