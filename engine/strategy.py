"""Which strategy one rank trains with: :func:`build` picks it from the configuration of
``python -m engine train``, among the 3D composition (:mod:`engine.hybrid`), ZeRO-3,
:class:`engine.dp.DataParallel` with a gradient compressor, expert parallelism
(:mod:`engine.moe.strategy`) and PyTorch's own DDP / ZeroRedundancyOptimizer / FSDP.

The :class:`Strategy` record and the step builders the strategies are made of live one layer
below, in :mod:`engine.steps` (re-exported here); this module only chooses and assembles.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine.hybrid import hybrid_strategy
from engine.models import GPTConfig, TinyGPT
from engine.moe.gpt import MOE_MODELS
from engine.moe.strategy import moe_strategy
from engine.pp import one_f_one_b
from engine.steps import (PRECISIONS, SCHEDULES, Autocast, Strategy, accumulate_step,
                          autocast, global_batch, lm_loss, parameter_count, pipeline_step)
from engine.topology import Mesh

__all__ = ["build", "zero3_strategy", "compressed_strategy", "torch_strategy",
           "register_torch_hook", "Strategy", "Autocast", "autocast", "accumulate_step",
           "pipeline_step", "global_batch", "lm_loss", "parameter_count", "PRECISIONS",
           "SCHEDULES"]


# -- the strategies of `engine train` ----------------------------------------------------------


def build(cfg, model: GPTConfig, impl: str, mesh: Mesh, device: torch.device,
          precision: str) -> Strategy:
    """The strategy ``cfg`` (a :class:`engine.train.TrainConfig`) names for a ``model``-sized
    GPT initialised from ``cfg.seed``, for ``impl`` "engine" or "torch", on ``mesh``. The
    model is built on the CPU; the 3D strategy moves only this rank's stage to ``device``."""
    if cfg.model in MOE_MODELS:
        return moe_strategy(cfg, model, mesh, device, precision)
    gpt = TinyGPT(model, seed=cfg.seed)
    if impl == "torch":
        return torch_strategy(gpt, cfg, mesh, device, precision)
    if cfg.compress is not None:
        return compressed_strategy(gpt, cfg, mesh, device, precision)
    if cfg.zero == 3:
        return zero3_strategy(gpt, cfg, mesh, device, precision)
    return hybrid_strategy(gpt, mesh, torch.optim.AdamW, cfg.zero, cfg.schedule,
                           cfg.microbatches, device, precision, lr=cfg.lr)


def zero3_strategy(gpt, cfg, mesh, device, precision) -> Strategy:
    """ZeRO-3 (:class:`engine.zero.ZeroDataParallel`) over the data-parallel group, its
    micro-batches through a one-stage pipeline. One unit per transformer block, the rest (the
    embeddings, the final norm and the head) the root unit, as torchtitan shards with
    ``fully_shard`` per block and :func:`torch_strategy` wraps FSDP: the same units on both
    sides, so ``--impl torch`` compares like with like (a unit per module that owns parameters
    would make 88 collectives a step on the tiny GPT against FSDP's 16)."""
    from engine.zero import ZeroDataParallel

    psi = parameter_count(gpt)
    model = ZeroDataParallel(autocast(gpt.to(device), precision), torch.optim.AdamW,
                             units=list(gpt.blocks), group=mesh.dp_group, lr=cfg.lr)
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
    ZeRO-1, FSDP (``SHARD_GRAD_OP`` / ``FULL_SHARD``) for ZeRO-2 / ZeRO-3, each transformer
    block wrapped on its own (the units of :func:`zero3_strategy`)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.optim import ZeroRedundancyOptimizer

    psi = parameter_count(gpt)
    module = autocast(gpt.to(device), precision)
    if cfg.zero >= 2:
        sharding = ShardingStrategy.SHARD_GRAD_OP if cfg.zero == 2 else \
            ShardingStrategy.FULL_SHARD
        blocks = ModuleWrapPolicy({type(block) for block in gpt.blocks})
        model = FSDP(module, device_id=device, sharding_strategy=sharding,
                     process_group=mesh.dp_group, auto_wrap_policy=blocks)
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
