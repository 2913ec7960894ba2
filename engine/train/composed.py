"""``engine train`` on the composed engine (:mod:`engine.compose`): one mesh of named axes,
one GPT parallelised by functions, one training loop. Every ``--impl engine`` run takes this
path, for every model and layout; ``--impl torch`` trains the same GPT on the same data with
PyTorch's wrappers (:func:`engine.train.torch_baseline.torch_strategy`). Then:

* the mesh is :class:`engine.topology.Mesh` ``(dp, tp, pp, cp=, ep=)``: world = dp x cp x tp
  x pp, and expert parallelism *borrows* its ranks from dp x cp (torchtitan's and
  Megatron-Core's meaning of ``--ep``);
* the model is :class:`engine.compose.model.GPT` with ``--model``'s sizes (``--vocab``: its
  vocabulary instead of the preset's; no bias on q, k, v:
  see :mod:`engine.compose.parity`). An MoE model runs *dropless* (capacity E/k: no token is
  dropped, so the routing does not depend on which tokens share a rank, as DeepSeek-V3 drops
  none: DeepSeek-AI 2024, section 2.1.2) with Switch's balancing loss (0.01) and ST-MoE's
  z-loss (1e-3), each computed over the global micro-batch, every rank of dp x cp's tokens,
  so that their gradients are one process's whatever the layout
  (:mod:`engine.compose.experts`); parallelised by
  :func:`engine.compose.parallelize.parallelize` for the :class:`engine.compose.plan.Plan` of
  the flags;
* ``--pp`` runs any schedule of the registry (:data:`COMPOSED_SCHEDULES`: the interleaved and
  V schedules hold 2 chunks per rank, so pp x 2 must divide the layers); ``--cp-method`` is
  ring attention (zig-zag or contiguous), Ulysses, all-gather or ``usp:UxR``
  (:mod:`engine.compose.usp`);
* step k trains on :func:`engine.model.tokens.batch_of_step` ``(k, dp x microbatches x
  micro-batch rows)``: the synthetic chain of :func:`engine.model.data.global_batch`, or with
  ``--data`` windows of a token file drawn from (seed, k) alone; the same sequences whatever
  the layout, so the loss of every step, the mean over every token that counts in the global
  batch (:mod:`engine.compose.loss`), can be compared with one process's;
* the step is :func:`engine.compose.loop.train_step`; the timing of its forward and backward
  is attached as a hook (:class:`ComputeTimer`), the meter by :func:`engine.train.timed_steps.
  run_steps` around it, as for every other strategy;
* ``--save``/``--resume``, every layout: every rank its own state (its stage, slices,
  experts, ZeRO shards, compressor memory: :mod:`engine.compose.resume`, written by
  :mod:`engine.checkpoint.per_rank`) and where each tensor of it sits in the dense GPT,
  bit-identical to an uninterrupted run on the same layout; ``--resume --reshard`` into any
  other layout of the same model and global batch (dp, cp and ``--cp-method``, tp, pp and
  ``--schedule``, ``--zero`` 0-3, micro-batches and their size): the files are joined
  offline into a dense state, parameters and AdamW's moments and step, and cut for this
  layout by the code that cuts a fresh model (:mod:`engine.compose.reshard`); the losses
  then equal one process's within 1e-6, experts spread over ``--ep`` ranks included (joined
  by their global index, cut by expert parallelism's own split). ``--compress`` saves and
  resumes (the compressor's error-feedback state is part of a rank's state); its
  ``--reshard`` is refused by name (:func:`check_composed_reshard`).

Every combination the plan cannot carry is refused before any rank starts
(:func:`check_composed`, :meth:`engine.compose.plan.Plan.check`), naming the flags.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from pathlib import Path

import torch

from engine.observe.clock import Clock
from engine.model.tokens import batch_of_step
from engine.compose.experts import moe_layers
from engine.compose.loop import train_step
from engine.compose.model import GPT, ModelConfig
from engine.compose.parallelize import parallelize
from engine.compose.resume import rank_state
from engine.compose.plan import CP_METHODS, Plan, check_cp_method
from engine.fsdp import MixedPrecisionPolicy
from engine.moe.gpt import MOE_MODELS
from engine.pp import SCHEDULES, PipelineRun
from engine.model.presets import MODELS
from engine.train.strategy import Strategy
from engine.topology import Mesh
from engine.observe.trace import TraceEvent

COMPOSED_SCHEDULES = tuple(SCHEDULES)  # every schedule of the registry (engine.pp)


def composed_world(cfg) -> int:
    """dp x cp x tp x pp: ``--ep`` borrows its ranks from dp x cp."""
    return cfg.dp * cfg.cp * cfg.tp * cfg.pp


def global_rows(cfg) -> int:
    """Sequences in the global batch of every step: dp x microbatches x micro-batch."""
    return cfg.dp * cfg.microbatches * cfg.micro_batch


def model_config(cfg) -> ModelConfig:
    """The composed GPT of ``--model``: its sizes (``--vocab``, if given, its vocabulary), its
    ``--attention`` kernel, no bias on q, k, v; an MoE model's experts and top-k, *dropless*,
    with the balancing loss and z-loss of :class:`engine.compose.model.ModelConfig` (module
    docstring)."""
    choices = dict(qkv_bias=False)
    moe = MOE_MODELS.get(cfg.model)
    if moe is not None:
        choices.update(num_experts=moe["num_experts"], top_k=moe["top_k"],
                       capacity_factor=moe["num_experts"] / moe["top_k"])
    gpt = replace(MODELS[cfg.model], attention=getattr(cfg, "attention", "written"))
    if getattr(cfg, "vocab", None) is not None:
        gpt = replace(gpt, vocab=cfg.vocab)
    return ModelConfig.from_gpt(gpt, **choices)


def plan_of(cfg) -> Plan:
    """The :class:`engine.compose.plan.Plan` of the flags (a ValueError naming a bad one)."""
    return Plan(dp=cfg.dp, cp=cfg.cp, ep=cfg.ep, tp=cfg.tp, pp=cfg.pp,
                cp_method=cfg.cp_method, schedule=cfg.schedule, zero=cfg.zero,
                compress=cfg.compress, micro_batches=cfg.microbatches,
                sequence_parallel=cfg.sequence_parallel)


def add_composed_arguments(p, defaults) -> None:
    """The command line's options of the composed engine (``defaults``: a TrainConfig)."""
    composed = p.add_argument_group("the composed engine (engine.train.composed)")
    composed.add_argument("--cp-method", default=defaults.cp_method, type=cp_method_arg,
                          metavar="{" + ",".join(CP_METHODS) + "}",
                          help="context-parallel attention: ring attention (zig-zag or "
                               "contiguous tokens), Ulysses, all-gather, or usp:UxR (Ulysses "
                               "over U ranks inside, ring over R groups across; U x R = --cp) "
                               "(default: %(default)s)")
    composed.add_argument("--sequence-parallel", action="store_true",
                          help="sequence parallelism inside tensor parallelism (--tp > 1): "
                               "LayerNorms and MoE layers between the tensor-parallel layers "
                               "on s/t tokens each, all-gathered and reduce-scattered "
                               "(Korthikanti et al. 2023) (default: %(default)s)")
    composed.add_argument("--varlen", action="store_true",
                          help="documents of random length packed with padding and a loss "
                               "mask (engine.compose.data) (default: %(default)s)")


def cp_method_arg(text: str) -> str:
    """``--cp-method``'s type: one of :data:`engine.compose.plan.CP_METHODS` (``usp:UxR``
    checked against ``--cp`` later, by the plan)."""
    import argparse

    try:
        return check_cp_method(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check_composed(cfg, world_size: int | None = None) -> None:
    """Every clear error for a composed run, before any rank starts."""
    if (cfg.dp * cfg.cp) % cfg.ep:
        raise ValueError(f"--ep {cfg.ep} must divide dp x cp = {cfg.dp} x {cfg.cp}: expert "
                         "parallelism borrows its ranks from data/context parallelism; give "
                         f"--dp {cfg.ep * cfg.dp // math.gcd(cfg.ep, cfg.dp * cfg.cp)}")
    if world_size is not None and composed_world(cfg) != world_size:
        raise ValueError(f"dp x cp x tp x pp = {cfg.dp} x {cfg.cp} x {cfg.tp} x {cfg.pp} = "
                         f"{composed_world(cfg)} does not match the world size {world_size} "
                         "(--ep borrows its ranks from dp x cp)")
    if cfg.reshard and not reshardable(cfg):
        raise ValueError("--reshard with the composed engine: it re-cuts the model's "
                         "parameters and AdamW state (engine.compose.reshard), not a "
                         "compressor's error-feedback residual, one rank's memory of its own "
                         "gradients; this run has "
                         f"--compress {cfg.compress}")
    if cfg.compress is not None:
        check_composed_compress(cfg)
    if getattr(cfg, "compile", False) and max(cfg.tp, cfg.cp, cfg.ep) > 1:
        raise ValueError(f"--compile with --tp {cfg.tp} --cp {cfg.cp} --ep {cfg.ep}: "
                         "torch.compile cannot trace the collectives inside a block yet "
                         "(tensor, context and expert parallelism issue them there); "
                         "expected --tp 1 --cp 1 --ep 1 (dp, ZeRO and pp compile)")
    try:
        plan = plan_of(cfg)
        plan.check(model_config(cfg), global_rows(cfg), cfg.varlen)
    except ValueError as e:
        raise ValueError(f"--dp {cfg.dp} --cp {cfg.cp} --ep {cfg.ep} --tp {cfg.tp} --pp "
                         f"{cfg.pp} --zero {cfg.zero} --microbatches {cfg.microbatches} "
                         f"--model {cfg.model}: {e}") from e


def psi_of(par) -> int:
    """The parameters of this rank's part of the model before ZeRO-3 shards them (its
    pipeline stage, split over tp; experts counted as this rank holds them)."""
    return sum(p.fsdp_layout.shape.numel() if hasattr(p, "fsdp_layout") else p.numel()
               for p in par.model.parameters())


def reshardable(cfg) -> bool:
    """Whether a composed run may resume another layout's checkpoint
    (:mod:`engine.compose.reshard`): any layout, not a compressor's error-feedback memory."""
    return cfg.compress is None


def check_composed_reshard(saved: dict, cfg, path) -> None:
    """``--resume --reshard`` of the composed checkpoint ``path`` (``saved``: its
    configuration): a ValueError naming ``--compress`` if this run compresses (a saved
    compressor's residuals are refused when the files are joined:
    :func:`engine.compose.reshard.universal_state`); every other layout change is re-cut
    (:mod:`engine.compose.reshard`)."""
    if cfg.compress is not None:
        raise ValueError(f"--resume --reshard: {path} is a checkpoint of the composed engine "
                         f"and this run has --compress {cfg.compress}: the error-feedback "
                         "residual is one rank's memory of its own gradients, no rank of "
                         "another layout continues it. Run with the saved layout")


def reshard_composed(path, strategy) -> None:
    """Load the composed checkpoint ``path`` of another layout into ``strategy`` (checked by
    :func:`check_composed_reshard`): joined into a dense state and cut for this rank
    (:func:`engine.compose.reshard.reshard`). Call on every rank."""
    from engine.compose.reshard import reshard

    reshard(path, strategy.rank_state[0].par)


def check_composed_compress(cfg) -> None:
    """``--compress`` plugs into the dense gradients' all-reduce over dp x cp: DDP's buckets,
    or the step's all-reduce in a pipeline or beside spread experts; ZeRO-0 only
    (:func:`engine.compose.parallelize.compressor_for`)."""
    from engine.compress.spec import make_compressor

    make_compressor(cfg.compress)  # a bad spec is a clear ValueError naming it
    if cfg.zero != 0:
        raise ValueError(f"--compress {cfg.compress} compresses the gradients' all-reduce over "
                         f"dp x cp: it needs --zero 0 (ZeRO-1 to 3 reduce-scatter), got --zero "
                         f"{cfg.zero}")


class ComputeTimer:
    """A loop hook: one ``FB`` compute event per step, from the step's start to the end of
    its backward (with DDP and ZeRO-2/3 the gradients reduced; a ZeRO-0/1 optimizer reduces
    at the step, after it), on this rank's :class:`engine.observe.clock.Clock`."""

    def __init__(self, device, rank: int):
        self.clock, self.rank, self.start, self.events = Clock(device), rank, None, []

    def on_step_start(self, step: int) -> None:
        self.start = self.clock.mark()

    def after_backward(self, step: int, par) -> None:
        start, end = self.clock.seconds(self.start), self.clock.seconds(self.clock.mark())
        self.events = [TraceEvent("FB", self.rank, start, end, lane="compute",
                                  args={"kind": "FB", "mb": 0, "chunk": 0})]


def mp_policy(plan: Plan, precision: str) -> MixedPrecisionPolicy | None:
    """bf16 at ZeRO-3: the parameters gathered in bf16 and the gradients reduced in fp32
    (FSDP2's ``MixedPrecisionPolicy``, as torchtitan trains), so that what autograd keeps for
    backward is the gathered storage ZeRO-3 frees after each module, not autocast's bf16 copy
    of it (held to the module's backward: the blocks' matrices in bf16 on every rank); the
    step still runs under autocast (it casts what is not sharded: spread experts). ``None``
    otherwise: autocast alone."""
    if precision == "bf16" and plan.zero == 3:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def composed_strategy(cfg, plan: Plan, mesh: Mesh, device: torch.device, precision: str
                      ) -> Strategy:
    """This rank's :class:`engine.train.strategy.Strategy` on the composed engine: ``step(k)`` trains
    on the global batch of step k."""
    from engine.moe.layer import single_rank_group

    model_cfg = model_config(cfg)
    alone = single_rank_group() if model_cfg.num_experts else None  # every rank: every expert
    gpt = GPT(model_cfg, seed=cfg.seed, expert_group=alone).to(device)
    par = parallelize(gpt, mesh, plan, torch.optim.AdamW, mp_policy=mp_policy(plan, precision),
                      lr=cfg.lr)
    if getattr(cfg, "compile", False):  # each block's forward; hooks (ZeRO-3's) stay eager
        for block in par.model.blocks:
            block.forward = torch.compile(block.forward)
    timer, rows = ComputeTimer(device, mesh.rank), global_rows(cfg)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else \
        contextlib.nullcontext()

    loads = ExpertLoads(par.model) if model_cfg.num_experts else None
    hooks = (timer,) if loads is None else (timer, loads)

    def step(k: int) -> PipelineRun:  # the run's step k, on step k's global batch
        batch = batch_of_step(k, rows, model_cfg.seq_len, model_cfg.vocab, cfg.seed + 1,
                              cfg.varlen, getattr(cfg, "data", None))
        with autocast:
            loss = train_step(par, batch, k, hooks=hooks)
        # a pipeline: the runtime's F/B(/W) events per micro-batch, which the report's idle
        # share is measured from; else one FB event of the step (ComputeTimer)
        events = timer.events if par.pipeline_run is None else [
            replace(e, rank=mesh.rank) for e in par.pipeline_run.events]  # stage -> rank
        return PipelineRun(loss, events)

    groups = {"dp x cp": mesh.dp_cp_group, "cp": mesh.cp_group}  # warmed up before step 0
    if plan.ep > 1:
        groups.update({"ep": mesh.ep_group, "expert-dp": mesh.expert_dp_group})
    strategy = Strategy(f"composed engine: {plan.name}" + (" varlen" if cfg.varlen else "")
                        + (f" on {Path(cfg.data).name}" if getattr(cfg, "data", None) else ""),
                        par.module, par.optimizer, step, psi_of(par), mesh,
                        device, engine=plan.ep == 1, groups=groups,
                        per_rank_checkpoint=True, rank_state=rank_state(par))
    if loads is not None:
        strategy.moe_stats = loads.moe_stats  # the report's expert loads and drop rates
    return strategy


class ExpertLoads:
    """A loop hook for an MoE model: per step, the rows this rank's experts processed (every
    MoE layer it holds, every micro-batch: :attr:`engine.moe.layer.MoEStats.processed`), the
    mean drop rate of its tokens' assignments (0 when dropless) and the (token, expert) rows
    its router kept for experts on other ranks (``crossing_rows``: the input of the
    expert-parallel formula, :func:`engine.compose.formulas.ep_formula`)."""

    def __init__(self, model):
        self.loads, self.drop_rates, self.crossing_rows = [], [], []
        self.load, self.drops, self.crossing = 0, [], 0
        for layer in moe_layers(model):
            layer.register_forward_hook(self.record)

    def record(self, layer, inputs, output) -> None:
        self.load += sum(layer.stats.processed)
        self.drops.append(layer.stats.drop_rate)
        mine = range(layer.first_expert, layer.first_expert + len(layer.experts))
        self.crossing += sum(n for e, n in enumerate(layer.stats.kept) if e not in mine)

    def on_step_end(self, step: int, loss: float) -> None:
        self.loads.append(self.load)
        self.drop_rates.append(sum(self.drops) / len(self.drops) if self.drops else 0.0)
        self.crossing_rows.append(self.crossing)
        self.load, self.drops, self.crossing = 0, [], 0

    def moe_stats(self) -> dict:
        return {"loads": self.loads, "drop_rates": self.drop_rates,
                "crossing_rows": self.crossing_rows}
