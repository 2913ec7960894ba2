"""Expert x data parallelism: which ranks hold which experts, and which group reduces which
gradient.

``dp x ep`` ranks, expert-parallel index fastest: ``rank = d * ep + e`` (so an expert-parallel
group is ``ep`` consecutive ranks, on one node when it fits: its all-to-alls are the heavy
traffic). Every rank reads its own tokens, holds a full copy of the dense weights (attention,
embeddings, norms, routers) and, in every MoE layer, the experts of its slot ``e`` of the
``ep`` slots. Each expert is thus held by ``dp`` ranks, one per expert-parallel group
(the "expert data parallel" group of DeepSpeed-MoE; Rajbhandari et al., ICML 2022).

**The gradient rule.** The loss is the mean over all ``dp * ep`` ranks of each rank's loss.

* A dense weight: each rank's gradient comes from its own tokens, so **average it over all
  dp x ep ranks** (``dense_group``), as in plain data parallelism.
* An expert weight on rank (d, e): backward sends every token's gradient back through the
  all-to-alls to the rank holding its expert, so that rank's gradient is already the **sum**
  over the ``ep`` ranks of its expert-parallel group. Only the other copies of the expert are
  missing: **sum it over its replicas** (``expert_dp_group``, ``dp`` ranks) **and divide by
  dp x ep**. Averaging over the replicas alone (dividing by ``dp``) would leave expert
  gradients ``ep`` times too large.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine.comm import ops
from engine.moe.gpt import expert_parameters
from engine.topology import Mesh
from engine.validation import positive_int


def check_layout(ep: int, dp: int, world_size: int, num_experts: int | None = None) -> None:
    """A ValueError naming the bad value, before any rank starts."""
    positive_int("ep", ep)
    positive_int("dp", dp)
    if ep * dp != world_size:
        raise ValueError(f"ep x dp = {ep} x {dp} = {ep * dp} does not match the world size "
                         f"{world_size}")
    if num_experts is not None and num_experts % ep:
        raise ValueError(f"ep = {ep} must divide num_experts = {num_experts}: each rank holds "
                         "the same number of whole experts")


class ExpertMesh:
    """The ``dp x ep`` layout of the world, with this rank's ``ep_group`` (the ranks its MoE
    layers spread experts over), ``expert_dp_group`` (the ranks holding the same experts) and
    ``dense_group`` (every rank: all hold the dense weights)."""

    def __init__(self, ep: int, dp: int):
        check_layout(ep, dp, dist.get_world_size())
        self.ep, self.dp = ep, dp
        self.rank = dist.get_rank()
        self.dp_index, self.ep_index = divmod(self.rank, ep)
        # a view of the one mesh: ep borrows its ranks from the dp x ep data-parallel ranks
        self.mesh = Mesh(dp=dp * ep, ep=ep)
        self.ep_group, self.expert_dp_group = self.mesh.ep_group, self.mesh.expert_dp_group
        self.dense_group = None  # the default group: every rank

    def __repr__(self) -> str:
        return f"ExpertMesh(ep={self.ep}, dp={self.dp})"


def reduce_gradients(model: nn.Module, mesh: ExpertMesh) -> None:
    """Apply the gradient rule (module docstring): one all-reduce for the dense gradients over
    every rank, one for the expert gradients over their replicas, both divided by dp x ep."""
    experts = {id(p) for p in expert_parameters(model)}
    params = [p for p in model.parameters() if p.grad is not None]
    dense = [p for p in params if id(p) not in experts]
    expert = [p for p in params if id(p) in experts]
    for group, part in ((mesh.dense_group, dense), (mesh.expert_dp_group, expert)):
        if part:
            flat = torch.cat([p.grad.reshape(-1) for p in part])
            ops.all_reduce(flat, group=group)
            flat /= mesh.dp * mesh.ep
            for p, g in zip(part, flat.split([p.numel() for p in part])):
                p.grad.copy_(g.view_as(p.grad))
