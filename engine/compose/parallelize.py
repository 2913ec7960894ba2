"""``parallelize(model, mesh, plan)``: one :class:`engine.compose.model.GPT` turned into this
rank's part of a parallel layout, by functions applied in a fixed order.

Only the last place is forced: the data-parallel wrapper flattens, buckets or shards the
parameters that exist when it runs, so it comes after every step that replaces modules (tensor
parallelism) or drops them (the pipeline split). The order of the first four is this engine's
choice: torchtitan's trainer splits the pipeline first and applies ``parallelize_llama`` (TP,
activation checkpointing, compile, then FSDP) to each stage, and its context parallelism is a
context manager around each step (``context_parallel``), not a module rewrite.

1. **Tensor parallelism** (Shoeybi et al. 2019), :func:`apply_tensor_parallel`: the embedding
   becomes vocab-parallel, the output layer column-parallel over the vocabulary (tied: the
   same slice), each attention's fused ``[q | k | v]`` column-parallel by heads (rank r: its
   ``1/t`` of the query heads and of the KV heads) and its output row-parallel, each MLP
   column- then row-parallel (SwiGLU: ``gate`` and ``fc`` column-parallel alike). With
   sequence parallelism (Korthikanti et al. 2023) the norms become their sequence-parallel
   forms (:func:`engine.tp.layers.sequence_parallel_norm`: LayerNorm or RMSNorm) and learned
   positions are scattered with the tokens.
2. **Context parallelism**, :func:`apply_context_parallel`: each attention's ``core`` becomes
   ring attention (Liu et al. 2023; zig-zag or contiguous layout), Ulysses (Jacobs et al.
   2023), all-gather (Llama 3) or USP (:mod:`engine.compose.usp`) over ``mesh.cp_group``.
   Nothing else changes: every other layer works token by token,
   and the data layer gives each rank its tokens and their positions.
3. **expert parallelism** (:mod:`engine.compose.experts`): each MoE layer keeps this rank's
   experts of ``mesh.ep_group``; their gradients are reduced over ``mesh.expert_dp_group``;
4. **the pipeline split** (:mod:`engine.compose.pipeline`): this rank's stage; the loop runs
   the plan's schedule over ``mesh.pp_group``;
5. **the data-parallel wrapper** over ``mesh.dp_cp_group`` (every rank that holds the same
   dense parameters and saw other tokens), :func:`apply_data_parallel`: ZeRO-0 is
   :class:`engine.dp.DataParallel`, ZeRO-1/2 :class:`engine.zero.ZeroOptimizer`, ZeRO-3
   :func:`apply_fully_shard`, PyTorch FSDP2's per-parameter design (:mod:`engine.fsdp`: each
   parameter sharded on dim 0, one all-gather and one reduce-scatter per module; over a
   tensor-parallel model each rank's slice is sharded again: the 2D layout);
   ``plan.compress``: the all-reduce of ZeRO-0 through a compressor (:mod:`engine.compress`):
   DDP's, or the stage-0 optimizer's (a pipeline; expert parallelism).
   Each averages over the group; :mod:`engine.compose.loss` scales the loss to match. In a
   pipeline ZeRO-0 is :class:`engine.zero.ZeroOptimizer` at stage 0 (one all-reduce at the
   step: the schedule runs many backward passes, some of weights only). ZeRO-3 shards each
   block and the root as torchtitan does (``fully_shard`` per block, then the model); in a
   pipeline, whose runtime calls the chunks' parts rather than the model, each module that
   owns parameters (a parameter two modules share, a tied embedding under the V placement, is
   the root's, held for the step), every one gathered for each micro-batch's forward and
   again for its backward and reduce-scattered once per micro-batch
   (:class:`engine.fsdp.step.ShardedStep`). Under a schedule with W actions (ZB-H1, ZB-H2,
   ZB-V, DualPipeV) the linear layers' gradients come in W, outside autograd
   (:func:`defer_linear_gradients`): ZeRO-3's late groups are freed after B as any but keep
   what came in their padded gradients, ZeRO-2's buckets keep theirs, and each W adds its
   ``dW = dY^T X`` and reduce-scatters them (:func:`engine.compose.pipeline.
   sharded_weight_grads`; W needs no weight, so nothing is gathered for it); ZeRO-0 and 1
   find W's gradients in ``.grad`` at the step. With experts spread (ep > 1): ZeRO-0 to 2
   run one :class:`engine.zero.ZeroOptimizer` of the stage per group (the experts' over
   ``mesh.expert_dp_group``), ZeRO-3 shards the dense parameters over ``mesh.dp_cp_group``
   (the experts are its ``ignored_params``, as FSDP's) and gives the experts a ZeRO-1
   optimizer over ``mesh.expert_dp_group``: their ``1/ep`` of the expert weights is already
   what expert parallelism divides, and that group is ``dp x cp / ep`` ranks (often one). In a
   pipeline each stage adds its MoE layers' router losses itself
   (:class:`engine.compose.pipeline.RouterLossScaler`); the tied embedding's gradient is then
   summed over its two stages (under ZeRO-3 its shard's: both stages hold the same rows).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from engine.compose.experts import (Optimizers, apply_expert_parallel, balance_globally,
                                    dense_parameters, expert_parameters,
                                    sequence_parallel_experts)
from engine.compose.model import GPT
from engine.compose.pipeline import apply_pipeline, sum_tied_embedding, tied_across_ranks
from engine.compose.plan import Plan, usp_degrees
from engine.compose.usp import usp_core
from engine.compress.spec import make_compressor
from engine.cp.allgather import allgather_attention
from engine.cp.ring import ring_attention
from engine.cp.ulysses import ulysses_attention
from engine.dp import DataParallel
from engine.fsdp import MixedPrecisionPolicy, fully_shard
from engine.fsdp.step import ShardedStep
from engine.pp.registry import build_schedule
from engine.topology import Mesh
from engine.tp.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                              sequence_parallel_norm)
from engine.tp.layout import heads_slice
from engine.zero import ZeroOptimizer


@dataclass
class Parallel:
    """This rank's parallelised model: ``model`` (parameters named as the dense GPT's),
    ``module`` (what the loop calls: ``model`` or its data-parallel wrapper), the
    ``optimizer``, ``no_sync`` (keeps a backward's gradients local), the ``tp_group`` the
    logits are split over (``None``: whole), ``replicas`` (ranks the wrapper averages
    gradients over) and ``finish_gradients`` (run after the last backward, before the
    step); ``pipeline_schedule``: with pp > 1, the plan's schedule, built and checked once
    (:func:`engine.pp.build_schedule`) and run at every step; ``pipeline_run``: with pp > 1,
    the :class:`engine.pp.PipelineRun` of the last step (its forward and backward events per
    micro-batch, which the trainer's pipeline idle share is measured from);
    ``late_gradients``: under a schedule with W actions, the ZeRO-2 and ZeRO-3 holders of
    sharded gradients that wait for W (:func:`defer_linear_gradients`); ``sharding``: at
    ZeRO-3, the :class:`engine.fsdp.step.ShardedStep` of the ``fully_shard``-ed modules."""

    model: GPT
    module: nn.Module
    optimizer: Any
    mesh: Mesh
    plan: Plan
    no_sync: Callable[[], Any]
    tp_group: Any
    replicas: int
    finish_gradients: Callable[[], None] = lambda: None
    pipeline_schedule: Any = None
    pipeline_run: Any = None
    late_gradients: list = field(default_factory=list)
    sharding: Any = None

    def gathered_step(self):
        """The context a pipeline step runs in: ZeRO-3's groups through the step
        (:meth:`engine.fsdp.step.ShardedStep.gathered`), else nothing."""
        return self.sharding.gathered() if self.sharding is not None else \
            contextlib.nullcontext()

    @property
    def compressing(self):
        """What reduces the dense gradients through ``plan.compress``'s compressor (its
        ``.compressor`` and ``.buckets``): the DDP wrapper, or the dense ZeroOptimizer at
        stage 0 (a pipeline, expert parallelism); ``None`` without one."""
        if self.plan.compress is None:
            return None
        if isinstance(self.module, DataParallel):
            return self.module
        return getattr(self.optimizer, "optimizers", (self.optimizer,))[0]


def qkv_heads_slice(whole: torch.Tensor, sizes: list[int], t: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a fused ``[q | k | v]`` weight or bias (``sizes``: the rows of
    q, k and v): :func:`engine.tp.layout.heads_slice`, the one cut, with ``sizes`` first."""
    return heads_slice(whole, t, rank, sizes)


def parallel_fused(dense: nn.Linear, sizes: list[int], group, rank: int, t: int, sp: bool
                   ) -> ColumnParallelLinear:
    """``dense``, the fused parts of ``sizes`` rows (``[q | k | v]``, SwiGLU's ``[gate |
    up]``), column-parallel: rank ``rank`` holds its ``1/t`` of each part, side by side."""
    fused = ColumnParallelLinear(dense.in_features, dense.out_features, dense.bias is not None,
                                 gather_output=False, group=group, device=dense.weight.device,
                                 dtype=dense.weight.dtype, sequence_parallel=sp)
    with torch.no_grad():
        fused.weight.copy_(qkv_heads_slice(dense.weight, sizes, t, rank))
        if dense.bias is not None:
            fused.bias.copy_(qkv_heads_slice(dense.bias, sizes, t, rank))
    return fused


def parallel_qkv(attn: nn.Module, group, rank: int, t: int, sp: bool) -> ColumnParallelLinear:
    d = attn.head_dim
    sizes = [attn.heads * d, attn.kv_heads * d, attn.kv_heads * d]
    return parallel_fused(attn.qkv, sizes, group, rank, t, sp)


def parallel_halves(dense: nn.Linear, group, rank: int, t: int, sp: bool
                    ) -> ColumnParallelLinear:
    """SwiGLU's fused ``[gate | up]``: rank ``rank`` holds its ``1/t`` of the gate's rows and
    of the up projection's, so ``silu(gate) * up`` is local
    (:data:`engine.tp.layout.HALVES`)."""
    half = dense.out_features // 2
    return parallel_fused(dense, [half, half], group, rank, t, sp)


def apply_tensor_parallel(model: GPT, mesh: Mesh, sequence_parallel: bool = False) -> None:
    """Step 1, in place: every layer that tensor parallelism splits, split over
    ``mesh.tp_group`` (module docstring)."""
    group, t, rank, sp = mesh.tp_group, mesh.tp, mesh.coords.tp, sequence_parallel
    tied = model.head.weight is model.tok.weight
    model.tok = VocabParallelEmbedding.from_dense(model.tok, group, sp)
    model.head = ColumnParallelLinear.from_dense(model.head, group, gather_output=False,
                                                 sequence_parallel=sp)
    if tied:
        model.head.weight = model.tok.weight  # rank r's vocabulary rows, for both
    for block in model.blocks:
        attn = block.attn
        attn.qkv = parallel_qkv(attn, group, rank, t, sp)
        attn.proj = RowParallelLinear.from_dense(attn.proj, group, input_is_parallel=True,
                                                 sequence_parallel=sp)
        attn.heads, attn.kv_heads = attn.heads // t, attn.kv_heads // t
        if block.moe is None:
            if hasattr(block, "gate_up"):  # SwiGLU: rank r holds its rows of gate and of up
                block.gate_up = parallel_halves(block.gate_up, group, rank, t, sp)
            else:
                block.fc = ColumnParallelLinear.from_dense(block.fc, group, gather_output=False,
                                                           sequence_parallel=sp)
            block.out = RowParallelLinear.from_dense(block.out, group, input_is_parallel=True,
                                                     sequence_parallel=sp)
        if sp:
            block.ln1, block.ln2 = (sequence_parallel_norm(ln, group)
                                    for ln in (block.ln1, block.ln2))
    if sp:
        model.ln_f = sequence_parallel_norm(model.ln_f, group)
        model.sp_group = group


def apply_context_parallel(model: GPT, mesh: Mesh, method: str = "ring-zigzag") -> None:
    """Step 2, in place: every attention spans the tokens of ``mesh.cp_group``."""
    if method == "allgather":  # Llama 3's: K/V all-gathered, zig-zag tokens
        core = functools.partial(allgather_attention, group=mesh.cp_group, causal=True,
                                 layout="zigzag")
    elif usp_degrees(method):  # Ulysses inside, ring across (engine.compose.usp)
        core = usp_core(mesh, usp_degrees(method)[0])
    elif method == "ulysses":
        core = functools.partial(ulysses_attention, group=mesh.cp_group, causal=True)
    else:
        layout = "zigzag" if method == "ring-zigzag" else "contiguous"
        core = functools.partial(ring_attention, group=mesh.cp_group, causal=True,
                                 layout=layout)
    for block in model.blocks:
        block.attn.core = core


def apply_data_parallel(model: GPT, mesh: Mesh, zero: int, optimizer_cls, compress=None,
                        mp_policy: MixedPrecisionPolicy | None = None, **kwargs
                        ) -> tuple[nn.Module, Any, Callable[[], Any]]:
    """Step 5: ``(module, optimizer, no_sync)`` for ZeRO stage ``zero`` over
    ``mesh.dp_cp_group``; ``compress``: a spec of :func:`engine.compress.spec.
    make_compressor` for the gradients' all-reduce (zero = 0: DDP's, or in a pipeline the
    step's); ``mp_policy``: ZeRO-3's (:func:`apply_fully_shard`)."""
    group = mesh.dp_cp_group
    compressor = compressor_for(compress, zero)
    if zero == 3:  # the model's parameters are its shards now: any optimizer steps them
        apply_fully_shard(model, group, pipeline=mesh.pp > 1, mp_policy=mp_policy)
        params = list(model.parameters())
        kwargs = multi_tensor(optimizer_cls, kwargs, params)
        return model, optimizer_cls(params, **kwargs), contextlib.nullcontext
    if mesh.pp > 1:
        optimizer = ZeroOptimizer(list(model.parameters()), optimizer_cls, stage=zero,
                                  group=group, compressor=compressor, **kwargs)
        return model, optimizer, contextlib.nullcontext
    if zero == 0:
        module = DataParallel(model, group=group, compressor=compressor)
        return module, optimizer_cls(model.parameters(), **kwargs), module.no_sync
    optimizer = ZeroOptimizer(list(model.parameters()), optimizer_cls, stage=zero, group=group,
                              **kwargs)
    return model, optimizer, contextlib.nullcontext


def multi_tensor(optimizer_cls, kwargs: dict, params: list[torch.Tensor]) -> dict:
    """``kwargs`` with ``fused=True`` (else ``foreach=True``) where the optimizer takes it and
    the caller chose neither: ZeRO-3 steps every shard as its own tensor, where ZeRO-1/2 step
    one flat bucket, so the cost of a step per tensor matters on CPUs too. AdamW over
    ``--model tiny``'s 28 shards, measured on one CPU core: 0.39 ms a step with ``foreach``
    (its bias corrections read each step count with ``.item()``), 0.12 ms fused, 0.11 ms over
    three flat tensors. torchtitan's default AdamW is the fused one too. ``params`` on a device
    without fused kernels (the meta device of a dry run): ``foreach``."""
    takes = inspect.signature(optimizer_cls).parameters
    if "fused" in kwargs or "foreach" in kwargs:
        return kwargs
    fusable = {p.device.type for p in params} <= set(_get_fused_kernels_supported_devices())
    if "fused" in takes and fusable:
        return {"fused": True, **kwargs}
    return {"foreach": True, **kwargs} if "foreach" in takes else kwargs


def apply_fully_shard(model: GPT, group, pipeline: bool, ignored_params=(),
                      mp_policy: MixedPrecisionPolicy | None = None) -> None:
    """ZeRO-3 of step 5, in place: ``fully_shard`` (:mod:`engine.fsdp`) over ``group`` on each
    transformer block (in a pipeline: on each module that owns parameters no other module
    shares), then on the model, which takes the rest (module docstring); ``ignored_params``
    (experts) stay as they are; ``mp_policy``: the dtypes every group gathers and reduces in
    (:class:`engine.fsdp.MixedPrecisionPolicy`; ``None``: the parameters'). The model's
    :class:`engine.fsdp.step.ShardedStep` is kept as ``model.sharded_step``."""
    ignored = {id(p) for p in ignored_params}
    if pipeline:
        owners = Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
        units = [m for m in model.modules() if m is not model
                 and any(id(p) not in ignored for p in m.parameters(recurse=False))
                 and all(owners[id(p)] == 1 for p in m.parameters(recurse=False))]
    else:  # torchtitan's: a unit per block, the rest (embeddings, final norm, head) the root
        units = [b for b in model.blocks if any(True for _ in b.parameters())]
    policy = mp_policy or MixedPrecisionPolicy()
    for unit in reversed(units):  # children before the modules around them
        fully_shard(unit, group, mp_policy=policy, ignored_params=ignored_params)
    fully_shard(model, group, mp_policy=policy, ignored_params=ignored_params)
    model.sharded_step = ShardedStep(model)


def compressor_for(compress: str | None, zero: int):
    """The compressor of ``compress`` (a spec of :func:`engine.compress.spec.
    make_compressor`; ``None``: none), which compresses an all-reduce: ZeRO-0 only."""
    if compress is not None and zero:
        raise ValueError(f"compress={compress!r} compresses the gradients' all-reduce: it "
                         f"needs zero = 0 (ZeRO-1 to 3 reduce-scatter), got zero = {zero}")
    return None if compress is None else make_compressor(compress)


def apply_expert_data_parallel(model: GPT, mesh: Mesh, zero: int, optimizer_cls,
                               across: bool = True, compress: str | None = None,
                               mp_policy: MixedPrecisionPolicy | None = None, **kwargs
                               ) -> tuple[nn.Module, Any, Callable[[], None]]:
    """Step 5 with experts spread over ``mesh.ep_group``: ``(module, optimizer,
    finish_gradients)``; the dense parameters over ``mesh.dp_cp_group`` (through the
    ``compress`` compressor at ZeRO-0), the experts' over ``mesh.expert_dp_group``
    (:mod:`engine.compose.experts`), each by a :class:`engine.zero.ZeroOptimizer` of the
    stage (ZeRO-0: one all-reduce of each at the step)."""
    compressor = compressor_for(compress, zero)
    # the experts' gradients: summed over the R / ep ranks holding a copy, divided by R
    experts = dict(group=mesh.expert_dp_group, divide_by=mesh.dp_cp_size, **kwargs)
    if zero == 3:  # dense: ZeRO-3 over dp x cp; experts: ZeRO-1 over expert_dp (docstring)
        apply_fully_shard(model, mesh.dp_cp_group, mesh.pp > 1, expert_parameters(model),
                          mp_policy)
        dense = [p for p in model.parameters() if hasattr(p, "fsdp_layout")]
        dense_kwargs = multi_tensor(optimizer_cls, kwargs, dense)
        optimizers = Optimizers(optimizer_cls(dense, **dense_kwargs),
                                ZeroOptimizer(expert_parameters(model), optimizer_cls, stage=1,
                                              **experts))
        return model, optimizers, lambda: sum_tied_embedding(model, mesh, None, across)
    optimizers = Optimizers(
        ZeroOptimizer(dense_parameters(model), optimizer_cls, stage=zero,
                      group=mesh.dp_cp_group, compressor=compressor, **kwargs),
        ZeroOptimizer(expert_parameters(model), optimizer_cls, stage=zero, **experts))
    return model, optimizers, lambda: sum_tied_embedding(model, mesh, optimizers.optimizers[0],
                                                         across)


def defer_linear_gradients(module: nn.Module, optimizer, schedule) -> list:
    """Under a schedule with W actions, declare every linear layer's parameters as getting
    their gradients late to what shards gradients during backward (ZeRO-3's
    :class:`engine.fsdp.step.ShardedStep`, ZeRO-2's :class:`engine.zero.stage2.
    GradientSharding`; the runtime defers each ``F.linear`` of the stage's weights:
    :mod:`engine.pp.weight_grad`); returns those holders, for the W actions
    (:func:`engine.compose.pipeline.sharded_weight_grads`). A row-parallel bias, added outside
    ``F.linear``, comes in B and waits in its buffer for the weight's W. ZeRO-0 and 1 reduce
    ``.grad`` at the step, where W's gradients are in already. ``schedule``: the built
    pipeline schedule (None without a pipeline)."""
    if schedule is None or not schedule.split:
        return []
    sharded = getattr(module, "sharded_step", None)
    holders = [sharded] if sharded is not None else []
    holders += [o.grad_sharding for o in getattr(optimizer, "optimizers", (optimizer,))
                if getattr(o, "grad_sharding", None) is not None]
    linear = (nn.Linear, ColumnParallelLinear, RowParallelLinear)
    params = [p for m in module.modules() if isinstance(m, linear)
              for p in m.parameters(recurse=False)]
    for holder in holders:
        holder.defer_gradients(params)
    return holders


def parallelize(model: GPT, mesh: Mesh, plan: Plan, optimizer_cls=torch.optim.AdamW, *,
                mp_policy: MixedPrecisionPolicy | None = None, **optimizer_kwargs) -> Parallel:
    """This rank's :class:`Parallel` of ``model`` (built whole, from the same seed, on every
    rank; changed in place) for ``plan`` on ``mesh`` (``plan.mesh()``: the groups of the plan's
    layout, built once), with ``optimizer_cls(**kwargs)``; ``mp_policy``: at ZeRO-3, the
    :class:`engine.fsdp.MixedPrecisionPolicy` every ``fully_shard`` call gets (FSDP2's
    ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``: the
    parameters gathered and computed with in bf16, the gradients reduced in fp32, the shards
    and the optimizer in fp32)."""
    if mp_policy is not None and plan.zero != 3:
        raise ValueError(f"mp_policy={mp_policy!r} is ZeRO-3's (the dtype fully_shard gathers "
                         f"in); this plan has zero = {plan.zero}: run it under torch.autocast")
    if plan.tp > 1:
        apply_tensor_parallel(model, mesh, plan.sequence_parallel)
    if plan.cp > 1:
        apply_context_parallel(model, mesh, plan.cp_method)
    tp_group = mesh.tp_group if plan.tp > 1 else None
    if plan.ep > 1:
        apply_expert_parallel(model, mesh)
    if plan.sequence_parallel:  # MoE layers on the whole sequence (engine.compose.experts)
        sequence_parallel_experts(model, mesh.tp_group)
    balance_globally(model, mesh)  # router losses over dp x cp (engine.compose.experts)
    schedule = None
    if plan.pp > 1:
        apply_pipeline(model, mesh, plan.schedule)
        schedule = build_schedule(plan.schedule, plan.pp, plan.micro_batches)  # once a run
    across = plan.pp == 1 or tied_across_ranks(plan.schedule)
    if plan.ep > 1:
        module, optimizer, finish = apply_expert_data_parallel(
            model, mesh, plan.zero, optimizer_cls, across, plan.compress, mp_policy,
            **optimizer_kwargs)
        return Parallel(model, module, optimizer, mesh, plan, contextlib.nullcontext, tp_group,
                        mesh.dp_cp_size, finish, schedule,
                        late_gradients=defer_linear_gradients(module, optimizer, schedule),
                        sharding=getattr(model, "sharded_step", None))
    module, optimizer, no_sync = apply_data_parallel(model, mesh, plan.zero, optimizer_cls,
                                                     plan.compress, mp_policy,
                                                     **optimizer_kwargs)
    return Parallel(model, module, optimizer, mesh, plan, no_sync, tp_group, mesh.dp_cp_size,
                    lambda: sum_tied_embedding(model, mesh, optimizer, across), schedule,
                    late_gradients=defer_linear_gradients(module, optimizer, schedule),
                    sharding=getattr(model, "sharded_step", None))
