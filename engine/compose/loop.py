"""The one training step and loop of the composed engine.

A step, whatever the layout: this rank's micro-batches of the step's global batch
(:mod:`engine.compose.data`), for each a forward, the loss normalised by the global token
count (:mod:`engine.compose.loss`) and a backward (gradients kept local but for the last
micro-batch, where the data-parallel wrapper reduces them over ``mesh.dp_cp_group``; experts'
over ``mesh.expert_dp_group``), then the optimizer step (and an MoE model's aux-loss-free
biases move). An MoE model's router losses (over the global micro-batch:
:mod:`engine.compose.experts`) are added to each micro-batch's loss, over the micro-batches (in a
pipeline each stage adds its own: :class:`engine.compose.pipeline.RouterLossScaler`). The
reported loss is the sum of every rank's local sums over the global count: one all-reduce of
one number, after the step.

What measures the run (the meter, the trace, memory accounting) is attached from outside as
*hooks*: any object with some of ``on_step_start(step)``, ``after_backward(step, par)``
(gradients reduced, optimizer not yet stepped) and ``on_step_end(step, loss)``.
"""

from __future__ import annotations

import contextlib

import torch

from engine.comm import ops
from engine.model.data import Batch, global_batch
from engine.compose.data import rank_slice
from engine.compose.experts import update_expert_biases
from engine.compose.loss import global_token_loss, masked_sum, micro_batch_mean
from engine.compose.parallelize import Parallel
from engine.compose.pipeline import loss_stage, pipeline_backward
from engine.compose.plan import usp_degrees
from engine.compose.usp import usp_tokens
from engine.validation import one_of

NORMALISATIONS = ("global", "micro-batch-mean")


def call_hooks(hooks, event: str, *args) -> None:
    for hook in hooks:
        method = getattr(hook, event, None)
        if method is not None:
            method(*args)


def my_micro_batches(par: Parallel, batch: Batch) -> list[Batch]:
    """This rank's micro-batches of the global ``batch``."""
    plan, c = par.plan, par.mesh.coords
    usp = usp_degrees(plan.cp_method)
    if usp is None:
        return rank_slice(batch, plan.dp, c.dp, plan.cp, c.cp, plan.cp_layout,
                          plan.micro_batches)
    tokens = usp_tokens(batch.ids.shape[1], plan.cp, usp[0], c.cp)  # USP's own layout
    return [Batch(mb.ids[:, tokens], mb.targets[:, tokens], mb.mask[:, tokens],
                  mb.positions[tokens])
            for mb in rank_slice(batch, plan.dp, c.dp, micro_batches=plan.micro_batches)]


def train_step(par: Parallel, batch: Batch, step: int = 0, hooks=(),
               normalisation: str = "global") -> float:
    """One optimizer step on the global ``batch``; returns the global loss (every rank).
    ``normalisation="micro-batch-mean"`` differentiates what a naive loop does instead (to
    measure how wrong it is)."""
    one_of("normalisation", normalisation, NORMALISATIONS)
    call_hooks(hooks, "on_step_start", step)
    device = next(iter(par.model.parameters())).device
    micro = [mb.to(device) for mb in my_micro_batches(par, batch)]
    global_tokens = batch.tokens
    par.optimizer.zero_grad()
    if par.plan.pp > 1:
        local = pipeline_backward(par, micro, global_tokens)
    else:
        local = accumulate(par, micro, global_tokens, normalisation)
    par.finish_gradients()
    call_hooks(hooks, "after_backward", step, par)
    par.optimizer.step()
    update_expert_biases(par.model, par.mesh)  # aux-loss-free biases, if any
    if par.replicas > 1:
        ops.all_reduce(local, group=par.mesh.dp_cp_group)
    if par.plan.pp > 1:  # the last virtual stage has the loss: every stage reports it
        holder = loss_stage(par.plan.schedule, par.mesh.pp)
        ops.broadcast(local, ops.group_ranks(par.mesh.pp_group)[holder], group=par.mesh.pp_group)
    # a dry run's tensors are on the meta device: shapes without values, no loss to read
    loss = float("nan") if local.is_meta else local.item() / global_tokens
    call_hooks(hooks, "on_step_end", step, loss)
    return loss


def accumulate(par: Parallel, micro: list[Batch], global_tokens: int, normalisation: str
               ) -> torch.Tensor:
    """Forward and backward of each micro-batch in turn (no pipeline); this rank's sum of
    token losses."""
    m = len(micro)
    local = torch.zeros((), device=micro[0].mask.device)
    for i, mb in enumerate(micro):
        with par.no_sync() if i < m - 1 else contextlib.nullcontext():
            logits = par.module(mb.ids, mb.positions)
            summed = masked_sum(logits, mb.targets, mb.mask, par.tp_group)
            if normalisation == "global":
                loss = global_token_loss(summed, global_tokens, par.replicas)
            else:
                loss = micro_batch_mean(summed, mb.mask, m)
            (loss + par.model.router_losses() / m).backward()
        local += summed.detach()
    return local


def train(par: Parallel, steps: int, rows: int, seed: int = 1, varlen: bool = False,
          hooks=(), normalisation: str = "global") -> list[float]:
    """``steps`` steps, step k on :func:`engine.model.data.global_batch` ``(k, rows, ...)``;
    the global losses."""
    cfg = par.model.cfg
    return [train_step(par, global_batch(k, rows, cfg.seq_len, cfg.vocab, seed, varlen), k,
                       hooks, normalisation) for k in range(steps)]
