"""Step 4 of :func:`engine.compose.parallelize.parallelize`: the pipeline split, and the
step that runs a schedule over the micro-batches.

**The split** (torchtitan's ``pipeline_llama``: the model definition tolerates missing
parts): each rank keeps the blocks of its stage (:func:`engine.pp.uniform_boundaries`; the
others become ``nn.Identity``, so names keep their global index), the first stage the
embeddings, the last the final LayerNorm and the output layer; :class:`engine.compose.model.
GPT` passes a hidden state through where the embedding is missing and returns it where the
output layer is. A tied output layer lives on the first *and* the last stage: its gradient is
summed over ``mesh.embedding_group`` before the step (Megatron-LM does the same).

**The step** runs one schedule of the registry (:data:`ONE_CHUNK`) through the engine's
runtime (:func:`engine.pp.run_pipeline`). The loss travels with the targets: each micro-batch's
labels are ``[targets; mask]``, and the last stage's loss is the global-token one
(:mod:`engine.compose.loss`), multiplied by ``m`` because the runtime divides by it.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.comm import ops
from engine.compose.loss import global_token_loss, masked_sum
from engine.pp import SCHEDULES, run_pipeline, uniform_boundaries
from engine.topology import Mesh

ONE_CHUNK = ("gpipe", "1f1b", "zb_h1")  # schedules with one model chunk per rank


def apply_pipeline(model: nn.Module, mesh: Mesh) -> None:
    """In place: keep this rank's stage of ``model`` (module docstring)."""
    layers = len(model.blocks)
    starts = uniform_boundaries(layers, mesh.pp) + [layers]
    stage = mesh.coords.pp
    for i in range(layers):
        if not starts[stage] <= i < starts[stage + 1]:
            model.blocks[i] = nn.Identity()
    if not mesh.is_first_stage:
        model.tok = model.pos = None  # a tied head keeps the weight it shares
    if not mesh.is_last_stage:
        model.ln_f = model.head = None


def sum_tied_embedding(model: nn.Module, mesh: Mesh, optimizer=None) -> None:
    """The tied weight's gradient summed over the first and the last stage. At ZeRO-2 its
    bucket reduce-scattered it over dp x cp during backward, cut at other places on the two
    stages: the bucket's gradient is gathered, the weight's part summed over the two stages,
    and each rank keeps its shard again (as :meth:`engine.hybrid.GPTStage.
    sync_tied_embedding`)."""
    if mesh.embedding_group is None or not model.cfg.tied:
        return
    holder = model.tok if mesh.is_first_stage else model.head if mesh.is_last_stage else None
    if holder is None:
        return
    weight = holder.weight
    if weight.grad is not None:  # a copy: under zero-bubble W the gradient is a view of a
        grad = weight.grad.detach().clone()  # split, which the counted ring may not modify
        ops.all_reduce(grad, group=mesh.embedding_group)
        weight.grad = grad
        return
    bucket = optimizer.launcher.bucket_of[weight]
    full = bucket.new_flat()
    ops.all_gather_into_tensor(full, bucket.shard_grad, group=mesh.dp_cp_group)
    ops.all_reduce(bucket.view_of(weight, full), group=mesh.embedding_group)
    bucket.shard_grad.copy_(bucket.shard_of(full))


class RouterLossScaler(torch.autograd.Function):
    """Megatron-Core's ``MoEAuxLossAutoScaler``: returns ``output`` unchanged, and its backward
    also differentiates ``losses`` with weight ``scale``. A pipeline stage's MoE layers add
    their router losses to the training loss this way: the loss itself lives on the last
    stage only, but the backward of every stage's output passes through here."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, losses: torch.Tensor, scale: float):
        ctx.scale, ctx.shape = scale, losses.shape
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, torch.full(ctx.shape, ctx.scale, dtype=grad_output.dtype,
                                       device=grad_output.device), None


class StageCall(nn.Module):
    """What the runtime calls: this rank's stage (or its data-parallel wrapper) on a
    micro-batch, with the positions of this rank's tokens. With MoE layers, their router
    losses ride on the output (:class:`RouterLossScaler`, weight ``1 / m`` each as in
    :func:`engine.compose.loop.accumulate`)."""

    def __init__(self, module: nn.Module, positions: torch.Tensor, model=None,
                 router_scale: float = 1.0):
        super().__init__()
        self.module, self.positions = module, positions
        self.model, self.router_scale = model, router_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.module(x, self.positions)
        losses = self.model.router_losses() if self.model is not None else 0.0
        if isinstance(losses, torch.Tensor) and losses.requires_grad:
            out = RouterLossScaler.apply(out, losses, self.router_scale)
        return out


def pipeline_backward(par, micro: list, global_tokens: int) -> torch.Tensor:
    """Forward and backward of every micro-batch through ``par.plan.schedule``; returns this
    rank's sum of token losses (0 off the last stage)."""
    m, mesh = len(micro), par.mesh
    schedule = SCHEDULES[par.plan.schedule].make(mesh.pp, m)
    sums = []

    def loss_fn(logits, labels):
        summed = masked_sum(logits, labels[0], labels[1].to(logits.dtype), par.tp_group)
        sums.append(summed.detach())
        return global_token_loss(summed, global_tokens, par.replicas) * m

    labels = [torch.stack([mb.targets, mb.mask.to(mb.targets.dtype)]) for mb in micro]
    run_pipeline([StageCall(par.module, micro[0].positions, par.model, 1.0 / m)], schedule,
                 [mb.ids for mb in micro], labels, loss_fn, stage=mesh.coords.pp,
                 group=mesh.pp_group)
    local = torch.stack(sums).sum() if sums else torch.zeros(())
    return local.to(micro[0].mask.device)
