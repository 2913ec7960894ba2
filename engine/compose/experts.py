"""Step 3 of :func:`engine.compose.parallelize.parallelize`: expert parallelism, and the
gradient rule it needs.

Every MoE layer keeps this rank's ``E / ep`` experts of ``mesh.ep_group``
(:meth:`engine.moe.MoE.from_dense`); the ep ranks are borrowed from the dp x cp ranks
(:class:`engine.topology.Mesh`), so each still reads its own tokens, and the all-to-alls
carry every token to the rank holding its expert and back.

**Which group reduces which gradient** (DeepSpeed-MoE, Rajbhandari et al. 2022; Megatron-Core's
expert data parallelism). Each rank differentiates ``local_sum * R / N``
(:mod:`engine.compose.loss`, ``R = dp x cp`` ranks, ``N`` tokens that count).

* A dense parameter: the average over the ``R`` ranks of ``mesh.dp_cp_group`` is
  ``sum / N``: one process's gradient.
* An expert's parameter: backward brings every token's gradient home through the
  all-to-alls, so the rank holding the expert already has the sum over its ep group; what is
  missing is the other copies of the expert, on ``mesh.expert_dp_group`` (``R / ep`` ranks).
  Summing there and dividing by ``R`` gives ``sum / N``; averaging there, as a data-parallel
  wrapper does, leaves it ``ep`` times too large, so :func:`engine.compose.parallelize.
  parallelize` gives the experts' :class:`engine.zero.ZeroOptimizer` ``divide_by = R``: it
  divides the sum itself, wherever the gradient came from (autograd, or a zero-bubble
  pipeline's W action, which no hook on the parameter would see).

**Balancing, the same in every layout.** Routing is per token: with no token dropped
(``capacity_factor >= E / k``) every token meets the same experts with the same gates whatever
the layout. The balancing losses are statistics of a batch, and the batch is the **global
micro-batch**: every token of micro-batch ``j`` of the step on every rank of
``mesh.dp_cp_group`` (the ranks holding different tokens; :mod:`engine.compose.data` makes
that set the same whatever dp), which is what one process running the step as ``m``
micro-batches of gradient accumulation routes in one call. :func:`balance_globally` makes
each MoE layer compute, after its forward, from one all-reduce of ``2E + 2`` numbers
(:func:`global_router_losses`):

* Switch's loss ``alpha E sum_i f_i P_i`` with ``f_i`` the global fraction of assignments to
  expert i and ``P_i`` its global mean router probability. The all-reduce is differentiable
  (:func:`engine.comm.autograd.all_reduce`): every rank holds the same loss, and the gradient
  of a rank's local sums is the sum of the ``R`` ranks' gradients, ``R`` times one process's
  share for its tokens, which the wrapper's average over ``R`` ranks brings back to one
  process's gradient, as ``replicas`` does for the LM loss (:mod:`engine.compose.loss`);
* ST-MoE's z-loss, the sum of ``logsumexp^2`` over the global count of tokens routed (padding
  included: the router sees it), the same way.

Each micro-batch's losses weigh ``1 / m`` (:mod:`engine.compose.loop`; Megatron-Core's
``MoEAuxLossAutoScaler``). The aux-loss-free bias (DeepSeek-V3; :mod:`engine.moe.balance`):
:func:`update_expert_biases`, after the optimizer step, sums each layer's loads of the step over
``mesh.dp_cp_group``, so every rank moves its bias as one process does. Their bytes:
:func:`balance_bytes`. Tensor-parallel ranks route the same tokens, so nothing is reduced
over tp (under sequence parallelism too: :func:`sequence_parallel_experts`). Qwen's
global-batch balancing loss (Qiu et al., "Demons in the detail", 2025) also reduces the
statistics over data parallelism.
"""

from __future__ import annotations

import torch
from torch import nn

from engine import theory
from engine.comm import ops
from engine.comm.autograd import all_reduce
from engine.moe.layer import MoE
from engine.topology import Mesh
from engine.tp.mappings import gather_sequence_for_replicated, scatter_to_sequence_parallel


def apply_expert_parallel(model: nn.Module, mesh: Mesh) -> None:
    """In place: every MoE layer (holding all its experts) keeps this rank's share of
    ``mesh.ep_group``."""
    for block in model.blocks:
        if block.moe is not None:
            block.moe = MoE.from_dense(block.moe, mesh.ep_group)


def sequence_parallel_experts(model: nn.Module, group) -> None:
    """In place, under sequence parallelism over ``group`` (the tensor-parallel ranks, each
    holding ``s/t`` of the tokens between sublayers): every MoE layer runs on the whole
    sequence, all-gathered on the way in, and gives back this rank's ``s/t`` on the way out
    (Megatron-Core's all-gather token dispatcher with sequence parallelism). The experts are
    whole on every tensor-parallel rank, so each computes the same layer on the same tokens
    (as without sequence parallelism): the gradient of its output is all-gathered, that of its
    input sliced (:func:`engine.tp.mappings.gather_sequence_for_replicated`), and the
    experts' and the router's gradients are the same on every rank, with nothing to reduce
    over tp. Per MoE layer and micro-batch: two all-gathers of ``bsh``, ``2 bsh (t-1)/t``."""
    for moe in moe_layers(model):
        moe.register_forward_pre_hook(
            lambda layer, args: (gather_sequence_for_replicated(args[0], group), *args[1:]))
        moe.register_forward_hook(
            lambda layer, args, out: scatter_to_sequence_parallel(out, group))


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The experts' parameters (not the routers: every rank holds those whole)."""
    return [p for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters()]


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    experts = {id(p) for p in expert_parameters(model)}
    return [p for p in model.parameters() if id(p) not in experts]


class Optimizers:
    """Two optimizers stepped as one: the dense parameters' and the experts' (each a
    :class:`engine.zero.ZeroOptimizer` over its own group)."""

    def __init__(self, *optimizers):
        self.optimizers = optimizers

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none)


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of the blocks this rank holds (a pipeline stage's others are
    ``nn.Identity``)."""
    return [b.moe for b in model.blocks if getattr(b, "moe", None) is not None]


def global_router_losses(logits: torch.Tensor, moe: MoE, group) -> tuple[torch.Tensor,
                                                                            torch.Tensor]:
    """``(aux_loss, z_loss)`` of ``moe``'s last forward over every token of ``group``
    (module docstring): ``logits`` [T, E] its router's output on this rank, ``moe.stats.demand``
    this rank's assignments per expert. ``group=None``: this rank's tokens alone."""
    experts = moe.num_experts
    demand = torch.tensor(moe.stats.demand, dtype=logits.dtype, device=logits.device)
    local = torch.cat([logits.softmax(dim=-1).sum(dim=0),
                       logits.logsumexp(dim=-1).square().sum()[None], demand,
                       logits.new_full((1,), logits.shape[0])])
    total = local if group is None else all_reduce(local, group)
    prob_sums, lse_squares, counts, tokens = total.split([experts, 1, experts, 1])
    f = counts / (tokens * moe.top_k)
    aux = moe.aux_loss_coef * experts * (f * prob_sums / tokens).sum()
    return aux, (moe.z_loss_coef * lse_squares / tokens).squeeze(0)


def balances_globally(model: nn.Module, mesh: Mesh) -> bool:
    """Whether :func:`balance_globally` changes anything: MoE layers with a balancing loss or
    a z-loss, on more than one rank of ``mesh.dp_cp_group``."""
    cfg = model.cfg
    return bool(cfg.num_experts) and mesh.dp_cp_size > 1 and \
        bool(cfg.aux_loss_coef or cfg.z_loss_coef)


def balance_globally(model: nn.Module, mesh: Mesh) -> None:
    """In place: each MoE layer's ``aux_loss`` and ``z_loss`` over the global micro-batch
    (module docstring; call after expert parallelism, which replaces the layers)."""
    if not balances_globally(model, mesh):
        return
    for moe in moe_layers(model):
        seen = {}
        moe.router.register_forward_hook(lambda router, inputs, out, seen=seen:
                                         seen.update(logits=out))

        def replace(layer, inputs, output, seen=seen):
            layer.aux_loss, layer.z_loss = global_router_losses(seen.pop("logits"), layer,
                                                                mesh.dp_cp_group)
        moe.register_forward_hook(replace)


def update_expert_biases(model: nn.Module, mesh: Mesh) -> None:
    """After the optimizer step: every MoE layer with an aux-loss-free bias moves it by the
    loads of the step summed over ``mesh.dp_cp_group`` (module docstring)."""
    group = mesh.dp_cp_group if mesh.dp_cp_size > 1 else "none"
    for moe in moe_layers(model):
        if moe.expert_bias is not None:
            moe.update_bias(group)


def balance_bytes(model: nn.Module, mesh: Mesh, micro_batches: int, steps: int = 1) -> float:
    """Bytes one rank sends over ``mesh.dp_cp_group`` for balancing in ``steps`` steps: per
    micro-batch and MoE layer the ``2E + 2`` fp32 statistics all-reduced forward and their
    gradient backward (:func:`balance_globally`), per step and layer with a bias its ``E``
    int64 loads (:func:`update_expert_biases`); each at the ring's cost for this rank's place
    in the ring (:func:`engine.theory.ring_all_reduce_rank_bytes`: ``2E + 2`` elements do not
    split evenly over every number of ranks)."""
    n, layers = mesh.dp_cp_size, moe_layers(model)
    if n == 1 or not layers:
        return 0.0
    experts, index = model.cfg.num_experts, ops.group_ranks(mesh.dp_cp_group).index(mesh.rank)
    per_step = 0.0
    if balances_globally(model, mesh):
        per_step += 2 * micro_batches * len(layers) * \
            theory.ring_all_reduce_rank_bytes(2 * experts + 2, 4, n, index)
    per_step += sum(theory.ring_all_reduce_rank_bytes(experts, 8, n, index) for moe in layers
                    if moe.expert_bias is not None)
    return steps * per_step
