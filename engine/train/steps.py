"""What one rank trains with, and how its step runs: the :class:`Strategy` record and the step
builders a strategy can be made of. The registry that picks a strategy for a configuration is
:func:`engine.train.run.build` (the composed engine, or PyTorch's wrappers);
:func:`engine.train.timed_steps.run_steps` runs the steps.

The builders here are the plain loops a learner reads and a benchmark times on its own:

* :func:`pipeline_step`: a step through the pipeline runtime (:func:`engine.pp.run_pipeline`),
  each loss scaled by ``1/m`` so the gradients sum to the full batch's mean;
* :func:`accumulate_micro_batches`: plain gradient accumulation, timed as a one-stage pipeline
  would be. :func:`accumulate_step` runs it under ``no_sync`` with one reduction in the last
  backward (chapter 02's exercise writes it).

``engine train`` itself steps with :func:`engine.compose.loop.train_step` (the composed
engine) or :func:`engine.train.torch_baseline.data_parallel_step` (PyTorch's wrappers), whose
loss is the global-token mean of :mod:`engine.compose.loss`.

Mixed precision (Micikevicius et al., "Mixed precision training", ICLR 2018) is
:func:`autocast`: fp32 weights, gradients and optimizer, matrix products in bf16. Where a rank
computes is decided in one place, :func:`engine.launch.device.rank_device`, and every tensor the
trainer hands to a collective is created there.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from engine.observe.memory import ActivationTracker, StateBytes, model_state_bytes
from engine.model.gpt import GPTConfig
from engine.model.data import token_data
from engine.pp import PipelineRun, run_pipeline
from engine.pp.registry import SCHEDULES as PIPELINE_SCHEDULES
from engine.pp.registry import schedule_spec
from engine.topology import Mesh
from engine.tp.layers import vocab_parallel_cross_entropy
from engine.observe.trace import Clock, TraceEvent

PRECISIONS = ("fp32", "bf16")
# the schedules of engine.pp's registry that a one-chunk-per-rank pipeline step runs
TRAINER_SCHEDULES = ("1f1b", "gpipe")
SCHEDULES = {name: PIPELINE_SCHEDULES[name].make for name in TRAINER_SCHEDULES}


def trainer_schedule(name: str, p: int, m: int):
    """The registered schedule ``name`` (one of :data:`TRAINER_SCHEDULES`) for ``p`` stages
    and ``m`` micro-batches; a ValueError naming ``name`` otherwise."""
    return schedule_spec(name, TRAINER_SCHEDULES).make(p, m)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Mean next-token cross-entropy from logits split over the vocabulary across
    ``tp_group`` (Megatron-LM's vocab-parallel cross-entropy; a one-rank group holds all of
    it). In fp32 whatever precision the model ran in."""
    return vocab_parallel_cross_entropy(logits.float(), targets, tp_group).mean()


def global_batch(cfg: GPTConfig, mesh: Mesh, microbatches: int, micro_batch: int,
                 device: torch.device, seed: int = 1):
    """This rank's ``microbatches`` micro-batches of ``micro_batch`` sequences: its
    data-parallel slice of one fixed global batch of ``dp * microbatches * micro_batch``
    sequences (every rank of a tensor- or pipeline-parallel group gets the same slice)."""
    rows = microbatches * micro_batch
    ids, targets = token_data(mesh.dp * rows, cfg.seq_len, cfg.vocab, seed=seed)
    mine = slice(mesh.coords.dp * rows, (mesh.coords.dp + 1) * rows)
    return (list(ids[mine].to(device).chunk(microbatches)),
            list(targets[mine].to(device).chunk(microbatches)))


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


def pipeline_step(chunk: nn.Module, optimizer, mesh: Mesh, schedule, inputs: list,
                  labels: list, before_step: Callable[[], None] = lambda: None):
    """A step through the pipeline runtime on the fixed micro-batches ``inputs``/``labels``
    (every step the same batch): this rank's stage ``chunk`` runs its part of ``schedule``;
    ``before_step`` finishes the gradients (the tied embedding's sum)."""

    def loss(logits, y):
        return lm_loss(logits, y, mesh.tp_group)

    def step(k: int) -> PipelineRun:
        optimizer.zero_grad()
        run = run_pipeline([chunk], schedule, inputs, labels, loss, stage=mesh.coords.pp,
                           group=mesh.pp_group)
        before_step()
        optimizer.step()
        return run

    return step


def accumulate_micro_batches(losses: Callable[[torch.Tensor, torch.Tensor], tuple],
                             inputs: list, labels: list, params: list, rank: int,
                             no_sync: Callable[[], Any] | None = None,
                             after_each: Callable[[], None] | None = None) -> PipelineRun:
    """Forward and backward over the micro-batches: ``losses(x, y)`` gives the loss to report
    and the one to differentiate (the same, or with the router losses added), whose ``1/m``
    makes the accumulated gradients the full batch's mean. ``no_sync``: the context that keeps
    a backward's gradients local, entered for every micro-batch but the last. Returns the
    :class:`engine.pp.PipelineRun` a one-stage pipeline would: the loss, one ``FB`` compute
    event per micro-batch (marked with :class:`engine.observe.trace.Clock`), the activation peak
    (:class:`engine.observe.memory.ActivationTracker`, parameters ``params`` excluded). The losses
    stay on the device until the last micro-batch is done and are read to the host once (on a
    GPU a read waits for the device, so a read per micro-batch would idle it inside the timed
    step); their sum is the same Python sum of the same floats as one ``.item()`` each."""
    m, clock = len(inputs), Clock(params[0].device)
    marks, reported, peak = [], [], 0
    for mb, (x, y) in enumerate(zip(inputs, labels, strict=True)):
        local = no_sync is not None and mb < m - 1
        with no_sync() if local else contextlib.nullcontext():
            start = clock.mark()
            with ActivationTracker(exclude=params) as acts:
                loss, total = losses(x, y)
                total = total / m
            total.backward()
            marks.append((mb, start, clock.mark()))
        peak = max(peak, acts.bytes)
        reported.append(loss.detach() / m)
        if after_each is not None:
            after_each()
    events = [TraceEvent(f"FB{mb}", rank, clock.seconds(s), clock.seconds(e), lane="compute",
                         args={"kind": "FB", "mb": mb, "chunk": 0}) for mb, s, e in marks]
    return PipelineRun(sum(torch.stack(reported).tolist()), events, peak, {0: peak}, 1)


def accumulate_step(model: nn.Module, optimizer, mesh: Mesh, inputs: list, labels: list):
    """A data-parallel step with gradient accumulation over the fixed micro-batches
    ``inputs``/``labels`` (every step the same batch): gradients stay local (``no_sync``)
    until the last micro-batch's backward, which reduces them once. Returns the same
    :class:`engine.pp.PipelineRun` a one-stage pipeline would, timed the same way."""

    params = list(model.parameters())

    def losses(x, y):
        loss = lm_loss(model(x), y, mesh.tp_group)
        return loss, loss

    def step(k: int) -> PipelineRun:
        optimizer.zero_grad()
        run = accumulate_micro_batches(losses, inputs, labels, params, mesh.rank,
                                       no_sync=model.no_sync)
        optimizer.step()
        return run

    return step
