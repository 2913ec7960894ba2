"""``--impl torch``: PyTorch's own DDP / ZeroRedundancyOptimizer / FSDP on the composed
engine's GPT and data (:func:`torch_strategy`), so ``--impl both`` prints the same loss per
step for both. The engine's side is :func:`engine.train.composed.composed_strategy`; the
:class:`engine.train.strategy.Strategy` record both fill lives one layer below.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from engine.comm import ops
from engine.model.tokens import batch_of_step
from engine.compose.data import rank_slice
from engine.compose.loss import global_token_loss, masked_sum
from engine.compose.model import GPT
from engine.pp import PipelineRun
from engine.train.strategy import Strategy, autocast, parameter_count
from engine.topology import Mesh
from engine.train.composed import ComputeTimer, global_rows, model_config


def torch_strategy(cfg, mesh: Mesh, device: torch.device, precision: str) -> Strategy:
    """PyTorch's own implementation of the same data-parallel configuration, on the composed
    engine's GPT (:func:`engine.train.composed.model_config`, the same seed): DDP (with its
    fp16/bf16 communication hook for ``--compress``), DDP + ZeroRedundancyOptimizer for
    ZeRO-1, FSDP (``SHARD_GRAD_OP`` / ``FULL_SHARD``) for ZeRO-2 / ZeRO-3, each transformer
    block wrapped on its own (torchtitan's ``fully_shard`` per block). The step is
    :func:`data_parallel_step`: the composed engine's data and loss."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.optim import ZeroRedundancyOptimizer

    gpt = GPT(model_config(cfg), seed=cfg.seed).to(device)
    psi = parameter_count(gpt)
    module = autocast(gpt, precision)
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
    step = data_parallel_step(model, optimizer, cfg, mesh, device)
    return Strategy(name + (" varlen" if cfg.varlen else ""), model, optimizer, step, psi,
                    mesh, device, engine=False)


def data_parallel_step(model: nn.Module, optimizer, cfg, mesh: Mesh, device: torch.device):
    """A step of a data-parallel ``model`` (PyTorch's wrappers) on the composed engine's data
    and loss: step k's global batch (:func:`engine.model.tokens.batch_of_step`: the
    synthetic chain, or ``--data``'s windows), this dp
    rank's rows of each of the ``--microbatches`` global micro-batches
    (:func:`engine.compose.data.rank_slice`), each loss the sum over its counted tokens times
    dp over the global count (:func:`engine.compose.loss.global_token_loss`: the wrapper's
    average over dp makes it one process's gradient), gradients kept local (``no_sync``) but
    for the last micro-batch. ``step(k)``: the run's step k; the returned loss is the global
    one, the same on every rank."""
    model_cfg, rows, m = model_config(cfg), global_rows(cfg), cfg.microbatches
    timer = ComputeTimer(device, mesh.rank)

    def step(k: int) -> PipelineRun:
        batch = batch_of_step(k, rows, model_cfg.seq_len, model_cfg.vocab, cfg.seed + 1,
                              cfg.varlen, getattr(cfg, "data", None))
        micro = [mb.to(device) for mb in rank_slice(batch, mesh.dp, mesh.coords.dp,
                                                    micro_batches=m)]
        timer.on_step_start(k)
        optimizer.zero_grad()
        local = torch.zeros((), device=device)
        for i, mb in enumerate(micro):
            with model.no_sync() if i < m - 1 else contextlib.nullcontext():
                summed = masked_sum(model(mb.ids, mb.positions), mb.targets, mb.mask)
                global_token_loss(summed, batch.tokens, mesh.dp).backward()
            local += summed.detach()
        timer.after_backward(k, None)
        optimizer.step()
        ops.all_reduce(local, group=mesh.dp_group)
        return PipelineRun(local.item() / batch.tokens, list(timer.events))

    return step


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
