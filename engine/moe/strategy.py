"""``python -m engine train --ep 2 --dp 2 --model tiny-moe``: the tiny MoE GPT under expert x
data parallelism, as one :class:`engine.steps.Strategy` per rank.

Every rank reads its own slice of the global batch (the trainer's mesh is data-parallel over
all ``dp x ep`` ranks), holds the dense weights and, in each MoE layer, the experts of its
expert-parallel slot (:class:`engine.moe.mesh.ExpertMesh`). A step accumulates the
micro-batches' gradients (each loss, router losses included, scaled by ``1/m``), then applies
the gradient rule once (:func:`engine.moe.mesh.reduce_gradients`: dense gradients averaged
over every rank, expert gradients summed over their replicas and divided by ``dp x ep``), then
steps AdamW. No ZeRO sharding here: every rank keeps its own parameters' optimizer state.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from engine import theory
from engine.moe.gpt import MOE_MODELS, TinyMoEGPT, expert_parallel, expert_parameters
from engine.moe.layer import single_rank_group
from engine.moe.mesh import ExpertMesh, check_layout, reduce_gradients
from engine.pp import PipelineRun
from engine.steps import Strategy, accumulate_micro_batches, autocast, lm_loss, parameter_count
from engine.train_formulas import Formula


def check_moe_config(cfg) -> None:
    """Clear errors, before any rank starts, for ``--ep`` and the MoE models."""
    moe = MOE_MODELS.get(cfg.model)
    if moe is None:
        if cfg.ep > 1:
            raise ValueError(f"--ep {cfg.ep} spreads experts, and --model {cfg.model} has none; "
                             f"use --model {' or '.join(MOE_MODELS)}")
        return
    for flag, value, wanted in (("--tp", cfg.tp, 1), ("--pp", cfg.pp, 1), ("--zero", cfg.zero, 0),
                                ("--impl", cfg.impl, "engine")):
        if value != wanted:
            raise ValueError(f"--model {cfg.model} trains with expert x data parallelism only "
                             f"(--ep, --dp): {flag} must be {wanted}, got {value}")
    if cfg.compress is not None:
        raise ValueError(f"--model {cfg.model} does not take --compress")
    check_layout(cfg.ep, cfg.dp, cfg.ep * cfg.dp, moe["num_experts"])


@dataclass
class MoEStrategy(Strategy):
    """A :class:`Strategy` that also records, per step, the rows this rank's experts
    processed and the drop rate of its tokens, over every MoE layer and micro-batch."""

    loads: list[int] = field(default_factory=list)
    drop_rates: list[float] = field(default_factory=list)

    def moe_stats(self) -> dict:
        return {"loads": self.loads, "drop_rates": self.drop_rates}


def moe_strategy(cfg, model_cfg, mesh, device, precision) -> MoEStrategy:
    """This rank's share of the tiny MoE GPT on an :class:`ExpertMesh` of ``cfg.ep x cfg.dp``
    (``mesh``: the trainer's data-parallel mesh over the same ranks)."""
    experts = ExpertMesh(cfg.ep, cfg.dp)
    full = TinyMoEGPT(model_cfg, **MOE_MODELS[cfg.model], seed=0, group=single_rank_group())
    model = expert_parallel(full, experts.ep_group).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    strategy = MoEStrategy(
        f"expert x data parallelism, ep {cfg.ep} x dp {cfg.dp}", model, optimizer, None,
        parameter_count(model), mesh, device,
        groups={"ep": experts.ep_group, "expert-dp": experts.expert_dp_group},
        per_rank_checkpoint=True)  # each rank its own experts: engine.rank_checkpoint
    strategy.step = _step(strategy, autocast(model, precision), experts)
    return strategy


def _step(strategy: MoEStrategy, forward, experts: ExpertMesh):
    """Accumulate the micro-batches (router losses included, :func:`engine.steps.
    accumulate_micro_batches`), recording each one's expert loads and drop rates; then the
    gradient rule once, then AdamW."""
    model, optimizer, mesh = strategy.model, strategy.optimizer, strategy.mesh
    params = list(model.parameters())

    def losses(x, y):
        loss = lm_loss(forward(x), y, mesh.tp_group)
        return loss, loss + model.router_losses()

    def step(inputs, labels) -> PipelineRun:
        optimizer.zero_grad()
        load, drops = 0, []

        def record():
            nonlocal load
            load += sum(sum(layer.stats.processed) for layer in model.moe_layers())
            drops.extend(layer.stats.drop_rate for layer in model.moe_layers())

        run = accumulate_micro_batches(losses, inputs, labels, params, mesh.rank,
                                       after_each=record)
        reduce_gradients(model, experts)
        optimizer.step()
        strategy.loads.append(load)
        strategy.drop_rates.append(statistics.fmean(drops))
        return run

    return step


# -- what the report prints -----------------------------------------------------------------


def moe_traffic_formulas(strategy: MoEStrategy, cfg) -> dict:
    """The gradient all-reduces of one step, by :mod:`engine.theory` (4-byte elements). The
    all-to-alls depend on where the router sends tokens: the report shows them counted, with
    the uniform-routing formula for scale."""
    n_dense, n_expert = cfg.dp * cfg.ep, cfg.dp
    expert = sum(p.numel() for p in expert_parameters(strategy.model))
    dense = strategy.psi - expert
    if cfg.ep == 1:  # the experts' replicas are every rank: both all-reduces on one group
        return {"dp": Formula(theory.ring_all_reduce_bytes(dense * 4, n_dense) +
                              theory.ring_all_reduce_bytes(expert * 4, n_dense),
                              f"2(N-1)/N x (Ψ_dense + Ψ_experts) x 4 B in two all-reduces, "
                              f"Ψ_dense = {dense:,}, Ψ_experts = {expert:,}, N = {n_dense}")}
    out = {"dp": Formula(theory.ring_all_reduce_bytes(dense * 4, n_dense),
                         f"2(N-1)/N x Ψ_dense x 4 B over every rank, Ψ_dense = {dense:,} "
                         f"(router included), N = {n_dense}")}
    if cfg.dp > 1:
        out["expert-dp"] = Formula(theory.ring_all_reduce_bytes(expert * 4, n_expert),
                                   f"2(dp-1)/dp x Ψ_experts x 4 B over the expert's replicas, "
                                   f"Ψ_experts = {expert:,}, dp = {n_expert}")
    return out


def print_moe_load(runs, cfg, model_cfg) -> None:
    """Per rank: the rows its experts processed per step, and its tokens' drop rate; the
    spread over ranks; the uniform-routing all-to-all bytes for scale."""
    moe = MOE_MODELS[cfg.model]
    tokens = cfg.microbatches * cfg.micro_batch * model_cfg.seq_len
    balanced = model_cfg.layers * tokens * moe["top_k"]  # rows per rank if perfectly even
    print(f"  expert load: rows this rank's experts processed per step, all {model_cfg.layers} "
          f"MoE layers and {cfg.microbatches} micro-batches (perfectly balanced: {balanced:,}); "
          "drop rate of its tokens' assignments:")
    for rank, r in enumerate(runs):
        stats = r["moe"]
        loads, drops = stats["loads"], stats["drop_rates"]
        print(f"    rank {rank} (ep slot {rank % cfg.ep}, replica {rank // cfg.ep}): load min "
              f"{min(loads):,} / mean {statistics.fmean(loads):,.0f} / max {max(loads):,}; "
              f"drop rate {statistics.fmean(drops):.1%}")
    last = [r["moe"]["loads"][-1] for r in runs]
    print(f"    per-rank load, last step: min {min(last):,} / mean {statistics.fmean(last):,.0f}"
          f" / max {max(last):,}: the slowest rank sets the pace")
    if cfg.ep > 1:
        per_layer = theory.moe_all_to_all_bytes(cfg.micro_batch * model_cfg.seq_len,
                                                model_cfg.hidden, moe["top_k"], cfg.ep, 4)
        scale = model_cfg.layers * cfg.microbatches * per_layer["total"]
        print(f"    ep: under uniform routing the all-to-alls would send {scale:,.0f} B per rank "
              "per step (theory.moe_all_to_all_bytes x layers x micro-batches), plus the "
              "token counts; the counted bytes follow the router")
