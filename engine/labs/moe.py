"""Load and drops, measured: synthetic routers, and a short training run with and without the
balancing loss. The notebook, the tests and the widget draw on these.

**A skewed router.** Real routers prefer some experts. ``zipf_logits`` models that: token t's
logit for expert i is ``noise + skew * log(1 / (i + 1))``, so expert i's share of the
probability falls like ``(i + 1)^-skew`` (a power law; ``skew = 0`` is uniform in
expectation).

**A short training run.** One :class:`MoE` layer learns a fixed random teacher MLP from
tokens ``x = z + 2u`` (``z`` Gaussian, ``u`` a fixed unit vector every token shares, as hidden
states of a real model share a mean direction). The skewed router starts with
``skew * log(1 / (i + 1)) * u / 2`` added to its weight, so its logits carry the power law of
``zipf_logits``. Every step records the drop rate and every expert's (and, under expert
parallelism, every rank's) load, and its MaxVio (:func:`engine.theory.max_violation`).

**Three balancers** on the same data and the same skewed start: none, Switch's loss
(``aux_coef``), and DeepSeek-V3's aux-loss-free bias (``bias_rate`` = gamma, the biases updated
after every optimizer step from the step's load, summed over the ranks). ``capacity_factor=None``
trains dropless.

**Under expert parallelism** (a :class:`engine.topology.Mesh` with ``ep > 1``) each rank reads
its own tokens and holds ``E / ep`` experts; the gradients follow the rule of
:mod:`engine.compose.experts` (which :func:`engine.compose.parallelize.parallelize` applies to a
whole GPT), here for one layer: :func:`expert_optimizers`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine import theory
from engine.comm import ops
from engine.moe.layer import MoE, single_rank_group
from engine.moe.router import route
from engine.topology import Mesh
from engine.zero import ZeroOptimizer


def zipf_bias(num_experts: int, skew: float) -> torch.Tensor:
    """``skew * log(1 / (i + 1))`` for each expert i: a power-law preference."""
    return -skew * torch.log(torch.arange(1, num_experts + 1, dtype=torch.float32))


def zipf_logits(tokens: int, num_experts: int, skew: float, seed: int = 0) -> torch.Tensor:
    """Router logits ``[tokens, E]``: standard normal noise plus :func:`zipf_bias`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, num_experts, generator=g) + zipf_bias(num_experts, skew)


def drop_rates(logits: torch.Tensor, top_k: int, factors) -> dict[float, float]:
    """``{capacity_factor: drop rate}`` for these logits."""
    return {cf: route(logits, top_k, cf).drop_rate for cf in factors}


@dataclass
class BalanceRun:
    """What a :func:`balance_run` measured, step by step (on one rank)."""

    drop_rate: list[float] = field(default_factory=list)  # this rank's tokens
    expert_load: list[list[int]] = field(default_factory=list)  # demand per expert, this rank
    rank_load: list[list[int]] = field(default_factory=list)  # rows each rank's experts ran
    loss: list[float] = field(default_factory=list)  # the task loss
    max_vio: list[float] = field(default_factory=list)  # MaxVio of the step's expert loads
    final_logits: torch.Tensor | None = None  # the trained router on fresh tokens


def _tokens(step: int, rank: int, tokens: int, hidden: int, direction: torch.Tensor):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(tokens, hidden, generator=g) + 2 * direction


def balance_run(skew: float, aux_coef: float, steps: int = 60, tokens: int = 128,
                hidden: int = 16, num_experts: int = 8, top_k: int = 2,
                capacity_factor: float | None = 1.25, lr: float = 0.01, seed: int = 0,
                mesh: Mesh | None = None, bias_rate: float | None = None) -> BalanceRun:
    """Train one MoE layer ``steps`` Adam steps (see the module docstring), in this process,
    or with its experts spread over ``mesh.ep_group`` (each rank its own tokens, gradients
    reduced by :func:`expert_optimizers`). ``bias_rate``: balance with DeepSeek-V3's bias,
    updated by that gamma after every step."""
    group = mesh.ep_group if mesh is not None else None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        direction = F.normalize(torch.randn(hidden), dim=0)
        teacher = nn.Sequential(nn.Linear(hidden, 32), nn.Tanh(), nn.Linear(32, hidden))
        dense = MoE(hidden, 2 * hidden, num_experts, top_k, capacity_factor,
                    group=_one_rank(mesh), aux_loss_coef=aux_coef, bias_update_rate=bias_rate)
        with torch.no_grad():
            dense.router.weight.normal_(0, 1 / math.sqrt(hidden))
            dense.router.weight += zipf_bias(num_experts, skew)[:, None] * direction / 2
    moe = MoE.from_dense(dense, group) if mesh is not None else dense
    with one_thread():
        return _train(moe, teacher, direction, steps, tokens, hidden, lr, mesh)


def expert_optimizers(moe: MoE, mesh: Mesh, optimizer_cls=torch.optim.Adam, **kwargs
                      ) -> list[ZeroOptimizer]:
    """The gradient rule of expert parallelism (:mod:`engine.compose.experts`) for one layer
    spread over ``mesh.ep_group``, as two :class:`engine.zero.ZeroOptimizer` of stage 0 (one
    all-reduce each at the step): the dense parameters (the router, any shared experts)
    averaged over ``mesh.dp_cp_group``, every rank's own tokens; the experts' summed over
    ``mesh.expert_dp_group`` (their other copies: backward's all-to-alls already brought home
    every token's gradient) and divided by ``dp x cp`` (``divide_by``), not by the group's
    size, which would leave them ``ep`` times too large."""
    experts = list(moe.experts.parameters())
    mine = {id(p) for p in experts}
    dense = [p for p in moe.parameters() if id(p) not in mine]
    return [ZeroOptimizer(dense, optimizer_cls, stage=0, group=mesh.dp_cp_group, **kwargs),
            ZeroOptimizer(experts, optimizer_cls, stage=0, group=mesh.expert_dp_group,
                          divide_by=mesh.dp_cp_size, **kwargs)]


def _train(moe, teacher, direction, steps, tokens, hidden, lr, mesh) -> BalanceRun:
    group, n = moe.group, moe.ep_size
    rank = mesh.rank if mesh is not None else 0  # each rank reads its own tokens
    optimizers = [torch.optim.Adam(moe.parameters(), lr=lr)] if mesh is None else \
        expert_optimizers(moe, mesh, lr=lr)
    run = BalanceRun()
    for step in range(steps):
        x = _tokens(step, rank, tokens, hidden, direction)
        with torch.no_grad():
            target = teacher(x)
        task = F.mse_loss(x + moe(x), x + target)
        for optimizer in optimizers:
            optimizer.zero_grad()
        (task + moe.aux_loss).backward()
        for optimizer in optimizers:
            optimizer.step()
        if moe.expert_bias is not None:  # every rank routes with the same biases
            total = moe.update_bias(group=mesh.dp_cp_group if mesh is not None else "none")
            run.max_vio.append(theory.max_violation(total.tolist()))
        else:
            run.max_vio.append(theory.max_violation(_global_load(moe.stats.demand, mesh)))
        run.drop_rate.append(moe.stats.drop_rate)
        run.expert_load.append(moe.stats.demand)
        run.rank_load.append(_rank_loads(sum(moe.stats.processed), group, n))
        run.loss.append(task.item())
    with torch.no_grad():
        run.final_logits = moe.router(_tokens(steps, rank, tokens, hidden, direction))
    return run


@contextlib.contextmanager
def one_thread():
    """Run tiny tensors on one thread: on a busy 2-core machine, two OpenMP threads per op made
    a 20-step run 40x slower here (16 s instead of 0.4 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _global_load(demand: list[int], mesh) -> list[int]:
    """Every expert's assignments over all ranks (one all-reduce), or this rank's alone."""
    if mesh is None:
        return demand
    load = torch.tensor(demand)
    ops.all_reduce(load, group=mesh.dp_cp_group)
    return load.tolist()


def _one_rank(mesh):
    """A group of this rank alone inside launched ranks (to build the full layer), else None."""
    return single_rank_group() if mesh is not None else None


def _rank_loads(processed: int, group, n: int) -> list[int]:
    """Rows processed by each rank's experts (one small all-gather)."""
    if n == 1:
        return [processed]
    everyone = torch.zeros(n, dtype=torch.long)
    ops.all_gather_into_tensor(everyone, torch.tensor([processed]), group=group)
    return everyone.tolist()
