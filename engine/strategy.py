"""One training strategy per rank: the model this rank holds, its optimizer, one training step
and the bytes it keeps, built from a configuration. ``python -m engine train`` and
:func:`engine.hybrid.train_3d` both build one and hand it to :func:`engine.timed_steps.run_steps`.

A step is the same on every path: zero the gradients, run forward and backward over the
``m`` micro-batches (each loss scaled by ``1/m``, so the gradients sum to the full batch's
mean), reduce the gradients the way the strategy does, step the optimizer. Two ways to run the
micro-batches:

* :func:`pipeline_step`: the pipeline runtime (:func:`engine.pp.run_pipeline`), for 3D
  parallelism (:mod:`engine.hybrid`) and for ZeRO-3 (one stage);
* :func:`accumulate_step`: plain gradient accumulation under ``no_sync`` with one reduction
  in the last backward, for :class:`engine.dp.DataParallel` (with a gradient compressor) and
  for PyTorch's own DDP and FSDP.

Where a rank computes is decided in one place, :func:`engine.device.rank_device`, and every
tensor the trainer hands to a collective is created there.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from engine.memory import ActivationTracker, StateBytes, model_state_bytes
from engine.models import GPTConfig, TinyGPT, token_data
from engine.pp import PipelineRun, gpipe, one_f_one_b, run_pipeline
from engine.topology import Mesh
from engine.tp.layers import vocab_parallel_cross_entropy
from engine.trace import Clock, TraceEvent

SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}
PRECISIONS = ("fp32", "bf16")


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
    """What one rank trains with. ``step(inputs, labels)`` runs one optimizer step over the
    micro-batches and returns the :class:`engine.pp.PipelineRun` (loss on the last stage,
    compute events, activation bytes). ``psi``: the parameters this rank's part of the model
    has before any ZeRO sharding (its pipeline stage's, split over tp)."""

    name: str
    model: nn.Module
    optimizer: Any
    step: Callable[[list, list], PipelineRun]
    psi: int
    mesh: Mesh
    device: torch.device
    engine: bool = True  # False: PyTorch's own wrappers, whose buckets live in C++
    groups: dict[str, Any] = field(default_factory=dict)  # more groups whose bytes to report
    # this rank's part of a dense TinyGPT, named as a checkpoint of ``model`` names it: the
    # code that cut the model, so a checkpoint of any layout can be re-cut with it
    # (engine.reshard); None where checkpoints are not supported
    part_of: Callable[[nn.Module], nn.Module] | None = None
    # True: checkpointed rank by rank, each its whole state (engine.rank_checkpoint), for
    # ranks that hold different parameters but shard none (expert parallelism)
    per_rank_checkpoint: bool = False

    @property
    def checkpointable(self) -> bool:
        return self.part_of is not None or self.per_rank_checkpoint

    def state_bytes(self) -> StateBytes | None:
        """What this rank holds (:func:`engine.memory.model_state_bytes`); None for
        PyTorch's wrappers, which it cannot see into."""
        return model_state_bytes(self.model, self.optimizer) if self.engine else None


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # a tied weight once


class Autocast(nn.Module):
    """Run ``module``'s forward under ``torch.autocast`` in ``dtype``: mixed precision
    (Micikevicius et al., "Mixed precision training", ICLR 2018) with fp32 weights, gradients
    and optimizer, matrix products in bf16. Backward follows the forward's dtypes."""

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


def pipeline_step(chunk: nn.Module, optimizer, mesh: Mesh, schedule,
                  before_step: Callable[[], None] = lambda: None):
    """A step through the pipeline runtime: this rank's stage ``chunk`` runs its part of
    ``schedule``; ``before_step`` finishes the gradients (the tied embedding's sum)."""

    def loss(logits, y):
        return lm_loss(logits, y, mesh.tp_group)

    def step(inputs, labels) -> PipelineRun:
        optimizer.zero_grad()
        run = run_pipeline([chunk], schedule, inputs, labels, loss, stage=mesh.coords.pp,
                           group=mesh.pp_group)
        before_step()
        optimizer.step()
        return run

    return step


def accumulate_step(model: nn.Module, optimizer, mesh: Mesh):
    """A data-parallel step with gradient accumulation: gradients stay local (``no_sync``)
    until the last micro-batch's backward, which reduces them once. Returns the same
    :class:`engine.pp.PipelineRun` a one-stage pipeline would, timed the same way."""

    params = list(model.parameters())

    def step(inputs, labels) -> PipelineRun:
        optimizer.zero_grad()
        m, clock = len(inputs), Clock(params[0].device)
        marks, losses, peak = [], [], 0
        for mb, (x, y) in enumerate(zip(inputs, labels, strict=True)):
            with contextlib.nullcontext() if mb == m - 1 else model.no_sync():
                start = clock.mark()
                with ActivationTracker(exclude=params) as acts:
                    loss = lm_loss(model(x), y, mesh.tp_group) / m
                loss.backward()
                marks.append((mb, start, clock.mark()))
            peak = max(peak, acts.bytes)
            losses.append(loss.detach())
        optimizer.step()
        events = [TraceEvent(f"FB{mb}", mesh.rank, clock.seconds(s), clock.seconds(e),
                             lane="compute", args={"kind": "FB", "mb": mb, "chunk": 0})
                  for mb, s, e in marks]
        return PipelineRun(sum(loss.item() for loss in losses), events, peak, {0: peak}, 1)

    return step


# -- the strategies of `engine train` ----------------------------------------------------------


def build(cfg, model: GPTConfig, impl: str, mesh: Mesh, device: torch.device,
          precision: str) -> Strategy:
    """The strategy ``cfg`` (a :class:`engine.train.TrainConfig`) names for a ``model``-sized
    GPT initialised from ``cfg.seed``, for ``impl`` "engine" or "torch", on ``mesh``. The
    model is built on the CPU; the 3D strategy moves only this rank's stage to ``device``."""
    from engine.moe.gpt import MOE_MODELS

    if cfg.model in MOE_MODELS:
        from engine.moe.strategy import moe_strategy

        return moe_strategy(cfg, model, mesh, device, precision)
    gpt = TinyGPT(model, seed=cfg.seed)
    if impl == "torch":
        return torch_strategy(gpt, cfg, mesh, device, precision)
    if cfg.compress is not None:
        return compressed_strategy(gpt, cfg, mesh, device, precision)
    if cfg.zero == 3:
        return zero3_strategy(gpt, cfg, mesh, device, precision)
    from engine.hybrid import hybrid_strategy

    return hybrid_strategy(gpt, mesh, torch.optim.AdamW, cfg.zero, cfg.schedule,
                           cfg.microbatches, device, precision, lr=cfg.lr)


def zero3_strategy(gpt, cfg, mesh, device, precision) -> Strategy:
    """ZeRO-3 (:class:`engine.zero.ZeroDataParallel`) over the data-parallel group, its
    micro-batches through a one-stage pipeline."""
    from engine.zero import ZeroDataParallel

    psi = parameter_count(gpt)
    model = ZeroDataParallel(autocast(gpt.to(device), precision), torch.optim.AdamW,
                             group=mesh.dp_group, lr=cfg.lr)
    step = pipeline_step(model, model.optimizer, mesh, one_f_one_b(1, cfg.microbatches))
    return Strategy("ZeRO-3", model, model.optimizer, step, psi, mesh, device,
                    part_of=lambda dense: autocast(dense, precision))


def compressed_strategy(gpt, cfg, mesh, device, precision) -> Strategy:
    """:class:`engine.dp.DataParallel` with the chapter-03 compressor ``cfg.compress`` on
    its bucket all-reduce; every rank keeps the whole AdamW state."""
    from engine.compress.experiment import make_compressor
    from engine.dp import DataParallel

    model = DataParallel(autocast(gpt.to(device), precision),
                         compressor=make_compressor(cfg.compress), group=mesh.dp_group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    return Strategy(f"DataParallel, gradients compressed with {cfg.compress}", model,
                    optimizer, accumulate_step(model, optimizer, mesh), parameter_count(gpt),
                    mesh, device)


def torch_strategy(gpt, cfg, mesh, device, precision) -> Strategy:
    """PyTorch's own implementation of the same data-parallel configuration: DDP (with its
    fp16/bf16 communication hook for ``--compress``), DDP + ZeroRedundancyOptimizer for
    ZeRO-1, FSDP (``SHARD_GRAD_OP`` / ``FULL_SHARD``) for ZeRO-2 / ZeRO-3."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.optim import ZeroRedundancyOptimizer

    psi = parameter_count(gpt)
    module = autocast(gpt.to(device), precision)
    if cfg.zero >= 2:
        sharding = ShardingStrategy.SHARD_GRAD_OP if cfg.zero == 2 else \
            ShardingStrategy.FULL_SHARD
        model = FSDP(module, device_id=device, sharding_strategy=sharding,
                     process_group=mesh.dp_group)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        name = f"FSDP {sharding.name}"
    else:
        model = nn.parallel.DistributedDataParallel(module, process_group=mesh.dp_group)
        if cfg.compress is not None:
            register_torch_hook(model, cfg.compress)
        if cfg.zero == 1:
            optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                                process_group=mesh.dp_group, lr=cfg.lr)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        name = "DDP" + (" + ZeroRedundancyOptimizer" if cfg.zero == 1 else "") + \
            (f" + {cfg.compress} hook" if cfg.compress else "")
    return Strategy(name, model, optimizer, accumulate_step(model, optimizer, mesh), psi,
                    mesh, device, engine=False)


def register_torch_hook(model, spec: str) -> None:
    """PyTorch's own DDP communication hook for the compressor ``spec`` names."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    kind = spec.split(":")[0]
    if kind == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif kind == "bf16":
        if dist.get_backend() != "nccl":
            raise ValueError("PyTorch's bf16_compress_hook needs NCCL; on Gloo compare "
                             "--compress fp16, or run bf16 with --impl engine")
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif kind != "dense":  # refused by check_config before any rank starts
        raise ValueError(f"no PyTorch DDP hook for --compress {spec}")
