"""The parity matrix: the same model from the same seed, trained on every layout, compared with
one process.

Each row trains :class:`engine.compose.model.GPT` (grouped-query attention; tied embeddings,
or untied where the row says so) for a few AdamW steps in fp32 on the global batches of
:mod:`engine.compose.data` (``varlen``: packed documents with padding and a loss mask), on at
most 8 CPU ranks launched by :func:`engine.launch`, through :func:`engine.compose.parallelize.
parallelize` and :func:`engine.compose.loop.train`. The reference is a plain single-process
loop: the whole global batch, the mean over its tokens that count, ``loss.backward()``, the
optimizer step. A row reports the largest difference of the loss at any step and of any
parameter on any rank, the seconds it took (launch included), and the bytes each kind of group
(dp, cp, ep, tp, pp) sent, counted on the wire by a :class:`engine.observe.meter.CommMeter` (its
collectives run on the engine's point-to-point rings) and summed over the ranks, beside the
formula for each kind (:mod:`engine.compose.formulas`; the experts' all-to-alls take the rows
the routers sent to other ranks, counted by a hook on each MoE layer, as input).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import torch

from engine.observe.meter import CommMeter
from engine.observe.nccl_rules import nccl_rules
from engine.model.data import global_batch
from engine.model.presets import MODELS
from engine.compose.experts import balance_bytes
from engine.compose.loss import masked_sum
from engine.compose.loop import train
from engine.compose.model import GPT, ModelConfig
from engine.compose.parallelize import parallelize
from engine.compose.pipeline import chunks_per_rank
from engine.compose.plan import Plan
from engine.compose.state import dense_state
from engine.compose.formulas import (dense_parameter_bytes, dp_formula, layout_formulas,
                                    ring_index)
from engine.compose.traffic import KINDS, bytes_by_kind

# No bias on q, k, v: the key bias's gradient is exactly zero in exact arithmetic (each
# query adds q . b_k to every score, and softmax ignores a shift), so in floating point it is
# rounding noise that depends on the order of the sums, and Adam, which divides by the
# gradient's own size, turns that noise into steps of size lr: no two layouts agree on it
# (measured: 1.7e-6 after 3 steps at lr 1e-3 where every other parameter agrees within 4e-8).
MODEL = ModelConfig(vocab=64, seq_len=16, layers=2, heads=4, hidden=32, kv_heads=2,
                    qkv_bias=False)
# The Llama rows: the same sizes with Llama 3's RMSNorm, rotary positions (each rank rotates
# its tokens by their global positions), SwiGLU, no biases and an untied head
LLAMA_MODEL = ModelConfig.from_gpt(MODELS["llama-tiny"])
# Adam divides each gradient element by its own running size, so an element that is a sum of
# terms cancelling to almost nothing (its relative rounding error large) moves by a different
# fraction of lr in each layout: the parameter differences scale with lr. At lr 1e-3 one
# untied-embedding element whose gradient is 8e-8 (summed from terms of 1e-2) differs by 7%
# between dp2 and one process and its parameter by 4.5e-6 after 3 steps; at lr 1e-4 every
# parameter still moves by about 3e-4, 300 times the tolerance, and the noise stays below it.
STEPS, ROWS, LR, SEED = 3, 4, 1e-4, 0
TOLERANCE = 1e-6
# Adam's step m/sqrt(v) does not change when a gradient is multiplied by a constant (only eps
# notices), so AdamW rows cannot see a gradient off by a factor: a tied embedding averaged
# instead of summed over its two stages (x 0.5) moves the parameters by 1.8e-7 in 3 steps,
# under the tolerance. Every row therefore runs once more with plain SGD, whose step is the
# gradient itself: at lr 0.1 a gradient off by any factor moves its parameter by lr times the
# error, far above 1e-6, while SGD adds no noise of its own to the rounding of the sums.
SGD_LR = 0.1
OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"lr": LR}), "sgd": (torch.optim.SGD, {"lr": SGD_LR})}


@dataclass(frozen=True)
class Row:
    """One layout of the matrix: a plan, the model's embedding choice and ``varlen``."""

    plan: Plan
    varlen: bool = False
    tied: bool = True
    moe: bool = False
    layers: int = 2  # multi-chunk schedules: 4 (two chunks of one layer on each of 2 ranks)
    optimizer: str = "adamw"  # or "sgd": sees a gradient off by a constant factor
    balance: str = ""  # MoE: "loss" (balancing loss and z-loss), "bias" (aux-loss-free)
    llama: bool = False  # LLAMA_MODEL's architecture (tied=False: its untied head)

    @property
    def name(self) -> str:
        return ("llama " if self.llama else "") + ("moe " if self.moe else "") + \
            self.plan.name + \
            ("" if self.tied else " untied") + (" varlen" if self.varlen else "") + \
            ("" if self.optimizer == "adamw" else f" {self.optimizer}") + \
            {"": "", "loss": " balanced", "bias": " bias"}[self.balance]


def _p(**kw) -> Plan:
    return Plan(micro_batches=2, **kw)


PHASE_1 = [_p(dp=2), _p(tp=2), _p(tp=2, sequence_parallel=True), _p(dp=2, tp=2),
           _p(dp=2, zero=1), _p(dp=2, zero=2), _p(dp=2, zero=3), _p(dp=2, tp=2, zero=1),
           _p(dp=2, tp=2, zero=2), _p(dp=2, tp=2, zero=3),
           _p(cp=2), _p(cp=2, cp_method="ring-contiguous"), _p(cp=2, cp_method="ulysses"),
           _p(dp=2, cp=2), _p(dp=2, cp=2, zero=3), _p(cp=2, tp=2),
           _p(cp=2, tp=2, sequence_parallel=True), _p(dp=2, cp=2, tp=2),
           _p(pp=2), _p(pp=2, schedule="zb_h1"), _p(pp=2, schedule="gpipe"), _p(dp=2, pp=2),
           _p(tp=2, pp=2), _p(cp=2, pp=2), _p(dp=2, pp=2, zero=1),
           _p(dp=2, tp=2, pp=2, zero=1), _p(dp=2, tp=2, pp=2, zero=2),
           _p(dp=2, pp=2, zero=3)]
MOE_LAYOUTS = [_p(dp=2), _p(dp=2, ep=2), _p(dp=2, ep=2, zero=1), _p(dp=2, ep=2, zero=2),
               _p(cp=2, ep=2), _p(dp=2, ep=2, tp=2), _p(dp=2, ep=2, tp=2, sequence_parallel=True),
               _p(dp=2, ep=2, pp=2),
               _p(dp=2, ep=2, zero=3)]
MULTI_CHUNK = [Plan(pp=2, schedule=name, micro_batches=4)
               for name in ("interleaved", "zb_v", "dualpipe_v")] + \
    [_p(dp=2, pp=2, schedule="interleaved", zero=3)]  # ZeRO-3 over a stage's two chunks
# Llama's rotary positions under every way of holding tokens: data, tensor (and sequence),
# context (ring zig-zag, Ulysses), pipeline, and their compositions
LLAMA_LAYOUTS = [_p(dp=2), _p(tp=2), _p(tp=2, sequence_parallel=True), _p(cp=2),
                 _p(cp=2, cp_method="ulysses"), _p(pp=2), _p(cp=2, pp=2), _p(cp=2, tp=2),
                 _p(dp=2, tp=2, pp=2, zero=1), _p(dp=2, zero=3)]
# the W actions of the zero-bubble schedules with what keeps gradients outside .grad: ZeRO-2's
# buckets, ZeRO-3's root unit (a tied embedding on one rank under the V placement), expert
# parallelism (alone, and DeepSeek-V3's layout: PP x EP x ZeRO-1 under DualPipe, here DualPipeV)
W_ROWS = [Row(_p(dp=2, pp=2, schedule="zb_h1", zero=2)),
          Row(_p(dp=2, pp=2, schedule="zb_v", zero=3), layers=4),
          Row(_p(dp=2, ep=2, pp=2, schedule="zb_h1", zero=1), moe=True),
          Row(Plan(cp=2, ep=2, pp=2, schedule="dualpipe_v", zero=1, micro_batches=4), moe=True,
              layers=4),
          # a row-parallel bias's gradient comes in B, its weight's in W: each W reduces only
          # the units it filled (a chunk-0 W reducing a chunk-1 unit early sent 63 KB more)
          Row(Plan(cp=2, tp=2, pp=2, schedule="zb_v", zero=3, micro_batches=4), varlen=True,
              layers=4)]
ROWS_PHASE_1 = [Row(plan, varlen) for varlen in (False, True) for plan in PHASE_1] + \
    [Row(plan, varlen, layers=4) for varlen in (False, True) for plan in MULTI_CHUNK] + \
    [Row(_p(dp=2, tp=2), tied=False), Row(_p(tp=2, sequence_parallel=True), True, False)] + \
    [Row(plan, varlen, moe=True) for varlen in (False, True) for plan in MOE_LAYOUTS] + \
    [Row(_p(dp=2, pp=2, schedule="zb_h1", zero=3), varlen=True)] + \
    W_ROWS + \
    [Row(plan, tied=False, llama=True) for plan in LLAMA_LAYOUTS]  # ZeRO-3's W: 4 s
# Lossy gradient compression (engine.compress has no lossless spec): expected to differ from
# one process, by at most drift_bound / loss_bound (below)
COMPRESSED_ROWS = [Row(_p(dp=2, compress="fp16")), Row(_p(dp=2, compress="bf16")),
                   Row(_p(dp=2, tp=2, compress="fp16")), Row(_p(dp=2, cp=2, compress="bf16")),
                   Row(_p(dp=2, compress="powersgd:1")), Row(_p(dp=2, compress="topk:0.1")),
                   # the step's all-reduce of a pipeline stage, and the dense part under ep
                   Row(_p(dp=2, pp=2, compress="powersgd:1")),
                   Row(_p(dp=2, ep=2, pp=2, schedule="zb_h1", compress="bf16"), moe=True)]
# Every layout without varlen once more with SGD (see OPTIMIZERS): the gradients themselves
SGD_ROWS = [replace(row, optimizer="sgd") for row in ROWS_PHASE_1 if not row.varlen]
# MoE with balancing over the global micro-batch (MOE and BALANCE below)
BALANCED_ROWS = [Row(_p(dp=2, ep=2), moe=True, balance="loss"),
                 Row(_p(dp=2, ep=2, tp=2), moe=True, balance="loss"),
                 Row(_p(dp=2, ep=2, pp=2), moe=True, balance="loss"),
                 Row(_p(dp=2, ep=2, pp=2, schedule="zb_h1"), moe=True, balance="loss"),
                 Row(_p(cp=2, ep=2), True, moe=True, balance="loss"),
                 Row(_p(dp=2, ep=2), moe=True, balance="bias")]
ALL_ROWS = ROWS_PHASE_1 + SGD_ROWS + COMPRESSED_ROWS + BALANCED_ROWS


def adam_step_bound(t: int, beta1: float = 0.9, beta2: float = 0.999) -> float:
    """The largest ``|m̂_t / √v̂_t|`` bias-corrected Adam can take at step ``t``, whatever the
    gradients: Cauchy-Schwarz on ``m_t = Σ w_i g_i`` against ``v_t = Σ u_i g_i²`` gives
    ``|m_t| / √v_t <= √(Σ w_i² / u_i)`` (1.0 at t = 1, 1.0014 at t = 2, 1.0036 at t = 3)."""
    w = [(1 - beta1) * beta1 ** (t - i) for i in range(1, t + 1)]
    u = [(1 - beta2) * beta2 ** (t - i) for i in range(1, t + 1)]
    return math.sqrt(sum(a * a / b for a, b in zip(w, u))) * math.sqrt(1 - beta2 ** t) / \
        (1 - beta1 ** t)


def drift_bound(steps: int = STEPS) -> float:
    """How far two AdamW runs from the same parameters can drift apart in ``steps`` steps,
    whatever their gradients: each moves a parameter by at most ``lr * adam_step_bound(t)`` at
    step t (AdamW's decay and eps only shrink it), so the two by twice the sum."""
    return 2 * LR * sum(adam_step_bound(t) for t in range(1, steps + 1)) + TOLERANCE


def loss_bound(grad_l1: float, steps: int = STEPS) -> float:
    """A bound on the loss difference of a compressed row: first order, the largest L1 norm
    of one process's gradient times the drift of the parameters before the last reported
    loss, doubled for the curvature along the way."""
    return 2 * grad_l1 * drift_bound(steps - 1) + TOLERANCE


@dataclass
class Result:
    row: Row
    world: int
    loss_diff: float
    param_diff: float
    seconds: float
    losses: list[float] = field(default_factory=list)
    sent: dict[str, int] = field(default_factory=dict)  # bytes per kind, summed over ranks
    dp_formula: float | None = None  # plain DDP/ZeRO's dp bytes (compressed rows: uncompressed)
    formulas: dict[str, float | None] = field(default_factory=dict)  # per kind, summed

    loss_tolerance: float = TOLERANCE  # compressed rows: loss_bound
    param_tolerance: float = TOLERANCE  # compressed rows: drift_bound

    @property
    def holds(self) -> bool:
        return self.loss_diff <= self.loss_tolerance and \
            self.param_diff <= self.param_tolerance


# MoE rows: 4 experts, top-2, a capacity of every token (capacity_factor = E / k: nothing is
# dropped, so routing does not depend on which tokens share a rank). The rows of MOE_LAYOUTS
# train without balancing or z-loss; the BALANCED_ROWS with them (Switch's 0.01, ST-MoE's 1e-3:
# ModelConfig's defaults), computed over each global micro-batch (engine.compose.experts), or
# with DeepSeek-V3's aux-loss-free bias alone (gamma 0.01: it changes choices within 3 steps)
MOE = dict(num_experts=4, top_k=2, capacity_factor=2.0, aux_loss_coef=0.0, z_loss_coef=0.0)
BALANCE = {"": {}, "loss": dict(aux_loss_coef=0.01, z_loss_coef=1e-3),
           "bias": dict(bias_update_rate=0.01)}


def model_config(row: Row) -> ModelConfig:
    return replace(LLAMA_MODEL if row.llama else MODEL, tied=row.tied, layers=row.layers,
                   **({**MOE, **BALANCE[row.balance]} if row.moe else {}))


def run_layout(rank: int, world_size: int, row: Row, steps: int = STEPS) -> dict:
    """One rank's run of ``row``: its global losses and its whole parameters."""
    from engine.moe.layer import single_rank_group

    plan, cfg = row.plan, model_config(row)
    mesh = plan.mesh()
    alone = single_rank_group() if row.moe else None  # every rank builds every expert
    optimizer_cls, kwargs = OPTIMIZERS[row.optimizer]
    par = parallelize(GPT(cfg, seed=SEED, expert_group=alone), mesh, plan, optimizer_cls,
                      **kwargs)
    # under NCCL's rules (engine.observe.nccl_rules) on Gloo too: every tensor handed to a
    # collective is on the rank's device, as a GPU run of the same row needs
    crossing = count_crossing_rows(par.model) if plan.ep > 1 else None
    with nccl_rules(), CommMeter(count="wire") as meter:
        losses = train(par, steps, ROWS, seed=SEED + 1, varlen=row.varlen)
    size, root, tied = dense_parameter_bytes(par)
    plain = dp_formula(size, mesh.dp_cp_size, plan.zero, steps, plan.micro_batches, root, tied,
                       chunks_per_rank(plan.schedule) if plan.pp > 1 else 1,
                       ring_index(mesh) if mesh.dp_cp_size > 1 else None,
                       plan.pp > 1) + \
        balance_bytes(par.model, mesh, plan.micro_batches, steps)
    formulas = layout_formulas(par, ROWS // (plan.dp * plan.micro_batches), steps,
                               None if crossing is None else sum(crossing))
    return {"losses": losses, "state": {**dense_state(par), **expert_biases(par.model)},
            "formula": plain,
            "formulas": {k: None if f is None else f.bytes for k, f in formulas.items()},
            "bytes": bytes_by_kind(meter.events, mesh, row.moe)}


def count_crossing_rows(model) -> list[int]:
    """A list that each MoE layer of ``model`` adds to, after every forward, the (token,
    expert) rows its router kept for experts on other ranks of its group: the input of the
    expert-parallel formula (:func:`engine.compose.formulas.ep_formula`)."""
    from engine.moe.layer import MoE

    rows: list[int] = []

    def hook(moe, inputs, output):
        mine = range(moe.first_expert, moe.first_expert + len(moe.experts))
        rows.append(sum(n for e, n in enumerate(moe.stats.kept) if e not in mine))

    for module in model.modules():
        if isinstance(module, MoE):
            module.register_forward_hook(hook)
    return rows


def expert_biases(model) -> dict[str, torch.Tensor]:
    """The MoE layers' aux-loss-free biases (buffers), compared as parameters are."""
    return {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}


def reference(cfg: ModelConfig, varlen: bool, steps: int = STEPS,
              optimizer_name: str = "adamw", micro_batches: int = 1) -> dict:
    """One process, no parallelism of any kind: the losses and the parameters. With
    ``micro_batches > 1`` (the MoE rows with balancing: their statistics are per micro-batch)
    gradient accumulation over the global micro-batches (:mod:`engine.compose.data`), each
    adding its MoE layers' own router losses (one call: every token of it) over ``m``; with
    a bias, every MoE layer moves it after the step from the step's loads."""
    model = GPT(cfg, seed=SEED)
    optimizer_cls, kwargs = OPTIMIZERS[optimizer_name]
    optimizer = optimizer_cls(model.parameters(), **kwargs)
    losses, grad_l1 = [], 0.0
    for k in range(steps):
        batch = global_batch(k, ROWS, cfg.seq_len, cfg.vocab, SEED + 1, varlen)
        optimizer.zero_grad()
        if micro_batches == 1:
            loss = masked_sum(model(batch.ids), batch.targets, batch.mask) / batch.tokens
            loss.backward()
        else:
            loss = 0.0
            for ids, targets, mask in zip(*(t.chunk(micro_batches) for t in
                                            (batch.ids, batch.targets, batch.mask))):
                part = masked_sum(model(ids), targets, mask) / batch.tokens
                (part + model.router_losses() / micro_batches).backward()
                loss += part.detach()
        grad_l1 = max(grad_l1, sum(p.grad.abs().sum().item() for p in model.parameters()))
        optimizer.step()
        for block in model.blocks:
            if block.moe is not None and block.moe.expert_bias is not None:
                block.moe.update_bias("none")
        losses.append(loss.item())
    return {"losses": losses, "grad_l1": grad_l1,
            "state": {**{n: p.detach().clone() for n, p in
                         model.named_parameters(remove_duplicate=False)},
                      **expert_biases(model)}}


def run_row(row: Row, steps: int = STEPS, timeout: float = 120) -> Result:
    """Check ``row``'s plan against the model, launch it, compare with one process."""
    from engine.launch import launch

    start = time.perf_counter()
    cfg = model_config(row)
    row.plan.check(cfg, ROWS, row.varlen)
    ranks = launch(run_layout, row.plan.world, row, steps, backend="gloo", timeout=timeout,
                   quiet=True)
    ref = reference(cfg, row.varlen, steps, row.optimizer,
                    row.plan.micro_batches if row.balance else 1)
    seconds = time.perf_counter() - start
    loss_diff = max(abs(a - b) for r in ranks for a, b in zip(r["losses"], ref["losses"],
                                                               strict=True))
    param_diff = max((t - ref["state"][n]).abs().max().item() for r in ranks
                     for n, t in r["state"].items())
    missing = set(ref["state"]) - {n for r in ranks for n in r["state"]}
    if missing:  # a parameter no rank holds
        param_diff = float("inf")
    sent = {k: sum(r["bytes"][k] for r in ranks) for k in KINDS}
    formula = sum(r["formula"] for r in ranks)
    per_kind = {k: None if any(r["formulas"][k] is None for r in ranks)
                else sum(r["formulas"][k] for r in ranks) for k in KINDS}
    bounds = (loss_bound(ref["grad_l1"], steps), drift_bound(steps)) if row.plan.compress \
        else (TOLERANCE, TOLERANCE)
    return Result(row, row.plan.world, loss_diff, param_diff, seconds, ranks[0]["losses"],
                  sent, formula, per_kind, *bounds)


def table(results: list[Result]) -> str:
    """One line per row: layout, world size, max |loss diff|, max |param diff|, seconds, and
    per kind of group the bytes sent (summed over ranks) / the formula's (``-``: none)."""
    lines = [f"{'layout':<34} {'world':>5} {'loss diff':>10} {'param diff':>10} "
             f"{'s':>5}  holds " + "".join(f" {k + ' counted/formula B':>21}" for k in KINDS)]
    for r in results:
        holds = ("yes" if r.holds else "NO") + ("*" if r.row.plan.compress else "")
        lines.append(f"{r.row.name:<34} {r.world:>5} {r.loss_diff:>10.1e} "
                     f"{r.param_diff:>10.1e} {r.seconds:>5.1f}  {holds:<5}"
                     + "".join(f" {traffic_cell(r.sent.get(k, 0), r.formulas.get(k)):>21}"
                               for k in KINDS))
    return "\n".join(lines)


def traffic_cell(counted: int, formula: float | None) -> str:
    """``counted/formula`` (``0`` when both are)."""
    if formula is None:
        return f"{counted}/-"
    return "0" if counted == formula == 0 else f"{counted}/{formula:.0f}"


def run_matrix(rows: list[Row] = ROWS_PHASE_1, steps: int = STEPS, echo: bool = True
               ) -> list[Result]:
    """Every row, in order; prints each line as it comes when ``echo``."""
    results = []
    for row in rows:
        results.append(run_row(row, steps))
        if echo:
            print(table(results).splitlines()[-1], flush=True)
    return results


def main(argv=None) -> int:
    """``python -m engine parity [--only TEXT] [--steps N]``: the table; 1 if a row fails."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m engine parity", description=__doc__)
    parser.add_argument("--only", default="", help="run the rows whose name contains this")
    parser.add_argument("--steps", type=int, default=STEPS, help="AdamW steps per row")
    args = parser.parse_args(argv)
    rows = [row for row in ALL_ROWS if args.only in row.name]
    if not rows:
        parser.error(f"no row's name contains {args.only!r}; the rows: "
                     + ", ".join(row.name for row in ALL_ROWS))
    print(table([]))
    start = time.perf_counter()
    results = run_matrix(rows, args.steps, echo=True)
    print(f"{sum(r.holds for r in results)} of {len(results)} rows within {TOLERANCE:g} of one "
          f"process (*: lossy compression, within drift_bound {drift_bound(args.steps):.1e} "
          f"and its loss bound), {time.perf_counter() - start:.0f} s")
    return 0 if all(r.holds for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
