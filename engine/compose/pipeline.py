"""Step 4 of :func:`engine.compose.parallelize.parallelize`: the pipeline split, and the
step that runs a schedule over the micro-batches.

**The split** (torchtitan's ``pipeline_llama``: the model definition tolerates missing
parts): each rank keeps the blocks of its stage (:func:`engine.pp.uniform_boundaries`; the
others become ``nn.Identity``, so names keep their global index), the first stage the
embeddings, the last the final LayerNorm and the output layer; :class:`engine.compose.model.
GPT` passes a hidden state through where the embedding is missing and returns it where the
output layer is. A tied output layer lives on the first *and* the last stage: its gradient is
summed over ``mesh.embedding_group`` before the step (Megatron-LM does the same).

**The step** runs any schedule of the registry (:data:`engine.pp.SCHEDULES`:
:func:`chunks_per_rank` model chunks per rank) through the engine's runtime
(:func:`engine.pp.run_pipeline`): the schedule built and checked once per run, when the plan
is applied (:attr:`engine.compose.parallelize.Parallel.pipeline_schedule`), and run at every
step. The loss travels with the targets: each micro-batch's labels are ``[targets; mask]``,
and the last stage's loss is the global-token one (:mod:`engine.compose.loss`), multiplied by
``m`` because the runtime divides by it.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.comm import ops
from engine.compose.loss import global_token_loss, masked_sum
from engine.pp import run_pipeline, schedule_spec, uniform_boundaries
from engine.pp.actions import virtual_stages
from engine.pp.weight_grad import apply_weight_grads, linear_weight_grad
from engine.topology import Mesh


def chunks_per_rank(schedule: str) -> int:
    """Model chunks each rank holds under ``schedule`` (its registry record's: 2 for the
    interleaved 1F1B, whose generator takes any number)."""
    return schedule_spec(schedule).chunks


def chunk_layout(layers: int, mesh: Mesh, schedule: str) -> list[tuple[int, int, int]]:
    """``(virtual stage, first block, end block)`` of each chunk this rank holds, in chunk
    order: the model cut into ``pp x v`` near-equal pieces, placed as the schedule says
    (:func:`engine.pp.actions.virtual_stages`: interleaved, or the V of ZB-V / DualPipeV)."""
    v = chunks_per_rank(schedule)
    starts = uniform_boundaries(layers, mesh.pp * v) + [layers]
    mine = virtual_stages(mesh.coords.pp, mesh.pp, v, schedule_spec(schedule).placement)
    return [(vs, starts[vs], starts[vs + 1]) for vs in mine]


def apply_pipeline(model: nn.Module, mesh: Mesh, schedule: str = "1f1b") -> None:
    """In place: keep this rank's chunks of ``model`` (module docstring): their blocks, the
    embeddings with virtual stage 0, the output layer with the last."""
    layers = len(model.blocks)
    chunks = chunk_layout(layers, mesh, schedule)
    last = mesh.pp * chunks_per_rank(schedule) - 1
    for i in range(layers):
        if not any(a <= i < b for _, a, b in chunks):
            model.blocks[i] = nn.Identity()
    if all(vs != 0 for vs, _, _ in chunks):
        model.tok = model.pos = None  # a tied head keeps the weight it shares
    if all(vs != last for vs, _, _ in chunks):
        model.ln_f = model.head = None


def loss_stage(schedule: str, pp: int) -> int:
    """The pipeline rank holding the last virtual stage, where the loss is: the last rank,
    or rank 0 under the V placement."""
    return 0 if schedule_spec(schedule).placement == "v" else pp - 1


def tied_across_ranks(schedule: str) -> bool:
    """Whether the first and the last virtual stage, which share a tied embedding, live on
    two ranks (the V placement puts both on rank 0: its gradient is whole there)."""
    return schedule_spec(schedule).placement != "v"


def sum_tied_embedding(model: nn.Module, mesh: Mesh, optimizer=None,
                       across_ranks: bool = True) -> None:
    """The tied weight's gradient summed over the first and the last stage. At ZeRO-2 its
    bucket reduce-scattered it over dp x cp during backward, cut at other places on the two
    stages: the bucket's gradient is gathered, the weight's part summed over the two stages,
    and each rank keeps its shard again (as Megatron-LM sums its tied embedding)."""
    if mesh.embedding_group is None or not model.cfg.tied or not across_ranks:
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


def dry_run_shapes(par, mb, virtual_stages: int) -> dict[int, tuple] | None:
    """On the meta device (a dry run, :mod:`engine.train.dry_run`) the activations' shape
    every virtual stage sends, ``(b, s, h)``, this rank's tokens (``s / tp`` of them under
    sequence parallelism); elsewhere None: the runtime reads them from its headers."""
    if not next(par.model.parameters()).is_meta:
        return None
    b, s = mb.ids.shape
    if par.plan.sequence_parallel:
        s //= par.mesh.tp
    return dict.fromkeys(range(virtual_stages), (b, s, par.model.cfg.hidden))


class ChunkCall(nn.Module):
    """What the runtime calls: one chunk of this rank's model (blocks ``start`` to ``end -
    1``, the embeddings when ``first``, the output layer when ``last``) on a micro-batch,
    with the positions of this rank's tokens. With MoE layers, the chunk's router losses
    ride on its output (:class:`RouterLossScaler`, weight ``1 / m`` each as in
    :func:`engine.compose.loop.accumulate`)."""

    def __init__(self, model: nn.Module, start: int, end: int, first: bool, last: bool,
                 positions: torch.Tensor, router_scale: float = 1.0):
        super().__init__()
        self.model, self.start, self.end = model, start, end
        self.first, self.last, self.positions = first, last, positions
        self.router_scale = router_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.model.embed(x, self.positions)
        out = self.model.run_blocks(x, self.start, self.end, self.positions)
        losses = self.model.router_losses(self.start, self.end)
        if isinstance(losses, torch.Tensor) and losses.requires_grad:
            out = RouterLossScaler.apply(out, losses, self.router_scale)
        return self.model.output(out) if self.last else out


def sharded_weight_grads(holders: list):
    """The W action (:mod:`engine.pp.weight_grad`) when sharded gradients wait for it:
    ``holders`` are what declared linear layers with ``defer_gradients`` (ZeRO-3's
    :class:`engine.fsdp.step.ShardedStep`, ZeRO-2's :class:`engine.zero.stage2.
    GradientSharding`; :func:`engine.compose.parallelize.defer_linear_gradients`). Each stashed
    layer's ``dW = dY^T X`` and ``db = sum dY`` go into its holder's gradient buffer (ZeRO-3:
    no weight needed, the unit stays freed), then every holder reduce-scatters
    (:meth:`engine.zero.late.LateGradients.reduce_late_grads`: ZeRO-2 every late bucket, as
    each B does under 1F1B, ZeRO-3 the units this W filled); a layer no holder owns (an
    expert under a ZeRO-1 optimizer) gets its ``.grad`` as without sharding."""
    if not holders:
        return apply_weight_grads

    def owner_of(weight):
        return next((h for h in holders if h.holds(weight)), None)

    @torch.no_grad()  # X may require grad (a stage's input): dW must not enter a graph
    def weight_grads(stash: list) -> None:
        owners = [owner_of(s[2]) for s in stash]
        apply_weight_grads([s for s, owner in zip(stash, owners) if owner is None])
        for (x, grad_out, weight, bias), owner in zip(stash, owners):
            if owner is None:
                continue
            grad_weight, grad_bias = linear_weight_grad(x, grad_out)
            owner.add_late_grad(weight, grad_weight)
            if bias is not None:
                owner.add_late_grad(bias, grad_bias)
        stash.clear()
        for holder in holders:
            holder.reduce_late_grads()

    return weight_grads


def pipeline_backward(par, micro: list, global_tokens: int) -> torch.Tensor:
    """Forward and backward of every micro-batch through ``par.pipeline_schedule`` (the
    plan's schedule, built once); returns this rank's sum of token losses (0 off the last
    stage) and keeps the runtime's :class:`engine.pp.PipelineRun` as ``par.pipeline_run``."""
    m, mesh, schedule = len(micro), par.mesh, par.pipeline_schedule
    if m != schedule.m:
        raise ValueError(f"the pipeline schedule was built for {schedule.m} micro-batches, "
                         f"the step has {m}")
    last = mesh.pp * schedule.v - 1
    chunks = [ChunkCall(par.model, a, b, vs == 0, vs == last, micro[0].positions, 1.0 / m)
              for vs, a, b in chunk_layout(len(par.model.blocks), mesh, schedule.name)]
    sums = []

    def loss_fn(logits, labels):
        summed = masked_sum(logits, labels[0], labels[1].to(logits.dtype), par.tp_group)
        sums.append(summed.detach())
        return global_token_loss(summed, global_tokens, par.replicas) * m

    labels = [torch.stack([mb.targets, mb.mask.to(mb.targets.dtype)]) for mb in micro]
    with par.gathered_step():  # ZeRO-3: its groups through the step (engine.fsdp.step)
        par.pipeline_run = run_pipeline(chunks, schedule, [mb.ids for mb in micro], labels,
                                        loss_fn, stage=mesh.coords.pp, group=mesh.pp_group,
                                        weight_grads=sharded_weight_grads(par.late_gradients),
                                        shapes=dry_run_shapes(par, micro[0], last + 1))
    for holder in par.late_gradients:  # a backward not split into B and W leaves its
        holder.flush_late_grads()  # gradients in a late buffer
    local = torch.stack(sums).sum() if sums else torch.zeros(())
    return local.to(micro[0].mask.device)
