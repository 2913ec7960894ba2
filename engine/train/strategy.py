"""What one rank trains with: the :class:`Strategy` record that :func:`engine.train.run.build`
fills (the composed engine, :func:`engine.train.composed.composed_strategy`, or PyTorch's
wrappers, :func:`engine.train.torch_baseline.torch_strategy`) and
:func:`engine.train.timed_steps.run_steps` runs; and the precision it computes in.

Mixed precision (Micikevicius et al., "Mixed precision training", ICLR 2018) is
:func:`autocast`: fp32 weights, gradients and optimizer, matrix products in bf16. Where a rank
computes is decided in one place, :func:`engine.launch.device.rank_device`, and every tensor the
trainer hands to a collective is created there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from engine.observe.memory import StateBytes, model_state_bytes
from engine.pp import PipelineRun
from engine.topology import Mesh

PRECISIONS = ("fp32", "bf16")


@dataclass
class Strategy:
    """What one rank trains with. ``step(k)`` runs the run's optimizer step ``k`` over the
    micro-batches and returns the :class:`engine.pp.PipelineRun` (loss on the last stage,
    compute events, activation bytes). ``psi``: the parameters this rank's part of the model
    has before any ZeRO sharding (its pipeline stage's, split over tp). Its bytes are named by
    the one classifier, :func:`engine.compose.traffic.report_traffic` (in
    :func:`engine.train.timed_steps.run_steps`), whichever implementation sent them."""

    name: str
    model: nn.Module
    optimizer: Any
    step: Callable[[int], PipelineRun]  # step k of the run -> what it measured
    psi: int
    mesh: Mesh
    device: torch.device
    engine: bool = True  # False: PyTorch's own wrappers, whose buckets live in C++
    # more groups the step communicates over, kind -> group: warmed up before the first
    # step (engine.train.timed_steps.warm_up_groups)
    groups: dict[str, Any] = field(default_factory=dict)
    # True: checkpointed rank by rank, each its whole state (engine.checkpoint.per_rank): the
    # composed engine, every layout; False: no checkpoint (PyTorch's wrappers)
    per_rank_checkpoint: bool = False
    # what a per-rank checkpoint saves and loads instead of (model, optimizer): two objects
    # with state_dict() / load_state_dict() (the composed engine: engine.compose.resume)
    rank_state: tuple | None = None

    def state_bytes(self) -> StateBytes | None:
        """What this rank holds (:func:`engine.observe.memory.model_state_bytes`); None for
        PyTorch's wrappers, which it cannot see into."""
        return model_state_bytes(self.model, self.optimizer) if self.engine else None


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # a tied weight once


class Autocast(nn.Module):
    """Run ``module``'s forward under ``torch.autocast`` in ``dtype``: mixed precision with
    fp32 weights, gradients and optimizer, matrix products in bf16. Backward follows the
    forward's dtypes."""

    def __init__(self, module: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.module, self.dtype = module, dtype

    def forward(self, *args):
        device_type = next(self.module.parameters()).device.type
        with torch.autocast(device_type, dtype=self.dtype):
            return self.module(*args)


def autocast(module: nn.Module, precision: str) -> nn.Module:
    """``module`` itself in fp32, wrapped in :class:`Autocast` in bf16."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return module if precision == "fp32" else Autocast(module, torch.bfloat16)


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto``: bf16 autocast on a GPU that has bf16, fp32 elsewhere."""
    if precision != "auto":
        return precision
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
