"""Parameter averaging and local SGD: the teaching counterexample, and the real algorithm.

"Data parallelism just averages the parameters" is wrong for stateful optimizers: averaging
parameters after each rank took its own Adam step is not the step Adam takes on the averaged
gradient, and each rank's moment estimates (exp_avg, exp_avg_sq) drift apart. Averaging the
*gradients* keeps every replica and every optimizer state identical.

Local SGD (Stich, "Local SGD converges fast and communicates little", ICLR 2019; Lin et al.,
"Don't use large mini-batches, use local SGD", ICLR 2020) makes parameter averaging a
deliberate trade: H local steps, then one average, so 1/H of the communication, at the price
of replicas that differ between averages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine.comm import ops
from engine.validation import positive_int


def average_parameters(module: nn.Module, group=None) -> None:
    """Replace every parameter by its mean over the group (one all-reduce per tensor)."""
    n = dist.get_world_size(group)
    with torch.no_grad():
        for p in module.parameters():
            ops.all_reduce(p.data, group=group)
            p.data.div_(n)


class LocalSGD:
    """Call :meth:`step` after each local optimizer step; it averages every ``period`` steps."""

    def __init__(self, module: nn.Module, period: int, group=None):
        positive_int("period (local steps between averages)", period)
        self.module, self.period, self.group = module, period, group
        self.steps = 0

    def step(self) -> bool:
        """Count one local step; average the parameters if it completes a period."""
        self.steps += 1
        if self.steps % self.period:
            return False
        average_parameters(self.module, self.group)
        return True
