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
  parallelize` puts a hook on each expert parameter that divides its gradient by ``ep`` as
  backward produces it.

Routing is per rank (GShard's groups): with no token dropped (``capacity_factor >= E / k``)
every token meets the same experts with the same gates whatever the layout, which is what
the parity rows check; the balancing loss is a per-rank statistic and is not additive over
tokens, so its rows set its coefficient to 0 (phase 2: compute it from all-reduced counts).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.comm import ops
from engine.moe.layer import MoE
from engine.topology import Mesh


def apply_expert_parallel(model: nn.Module, mesh: Mesh) -> None:
    """In place: every MoE layer (holding all its experts) keeps this rank's share of
    ``mesh.ep_group``."""
    for block in model.blocks:
        if block.moe is not None:
            block.moe = MoE.from_dense(block.moe, mesh.ep_group)


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The experts' parameters (not the routers: every rank holds those whole)."""
    return [p for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters()]


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    experts = {id(p) for p in expert_parameters(model)}
    return [p for p in model.parameters() if id(p) not in experts]


def reduce_gradients(model: nn.Module, mesh: Mesh) -> None:
    """The rule without a wrapper: dense gradients summed over ``dp_cp_group``, experts'
    over ``expert_dp_group``, both divided by dp x cp; one all-reduce per group."""
    for group, params in ((mesh.dp_cp_group, dense_parameters(model)),
                          (mesh.expert_dp_group, expert_parameters(model))):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if not grads:
            continue
        flat = torch.cat([g.reshape(-1) for g in grads])
        ops.all_reduce(flat, group=group)
        flat /= mesh.dp_cp_size
        for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.grad = g.view_as(p).clone()


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
