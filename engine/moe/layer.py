"""``MoE``: a mixture-of-experts MLP whose experts are spread over the ranks of a group.

The layer replaces a transformer block's MLP (Shazeer et al. 2017; Lepikhin et al., GShard,
2021; Fedus et al., Switch, 2022). For each token the router picks ``top_k`` experts
(:mod:`engine.moe.router`); the token's rows go to the ranks holding those experts and back
(:mod:`engine.moe.dispatch`); the output is the experts' outputs weighted by the gates. An
assignment over capacity is dropped: the token gets nothing from that expert, and with
nothing from any it leaves the layer as zeros, so ``x + moe(x)`` passes it through.

**Expert parallelism.** With ``group`` of ``n`` ranks, each rank holds ``E/n`` whole experts
(rank r: experts ``r E/n`` to ``(r+1) E/n - 1``) and a full copy of the router. No expert is
split: an expert is an ordinary MLP, which fits on one GPU, so experts need no tensor
parallelism; what grows with ``E`` is the number of experts, and that is what the ranks split.

**Routing is per rank.** Every rank routes its own tokens: the capacity, the drops and the
balancing loss are computed over the tokens the layer sees in one call on one rank (GShard's
"groups"). So expert parallelism over ``n`` ranks equals one process running the same layer
once on each rank's tokens, which is what the tests check.

The layer keeps its last ``aux_loss`` (Switch's load-balancing loss, times
``aux_loss_coef``), ``z_loss`` (ST-MoE's router z-loss, times ``z_loss_coef``) and ``stats``
(:class:`MoEStats`): add the two losses to the training loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.moe.dispatch import combine, dispatch, inverse
from engine.moe.router import check_routing, load_balancing_loss, route, router_z_loss
from engine.validation import divides, positive_int


class Expert(nn.Module):
    """One expert: the transformer MLP, ``Linear(h, f) -> GELU -> Linear(f, h)``."""

    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.fc = nn.Linear(hidden, ffn_hidden)
        self.out = nn.Linear(ffn_hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


@dataclass
class MoEStats:
    """What the last forward did on this rank."""

    demand: list[int]  # this rank's assignments to each expert (all E), before capacity
    kept: list[int]  # the same after capacity
    capacity: int  # slots per expert for this rank's tokens
    drop_rate: float  # dropped / all assignments of this rank's tokens
    processed: list[int]  # rows this rank's experts processed (from every rank), per expert


def ep_rank_and_size(group) -> tuple[int, int]:
    """This rank's index in ``group`` and its size; ``(0, 1)`` without torch.distributed."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def single_rank_group():
    """A process group holding only this rank, for building a layer with all its experts
    inside a launched rank (to take experts from with :meth:`MoE.from_dense`). Collective:
    every rank of the default group must call it."""
    return dist.new_subgroups(group_size=1)[0]


class MoE(nn.Module):
    """``top_k`` of ``num_experts`` experts per token, experts spread over ``group``.

    ``group``: the expert-parallel group (``None``: the default group when torch.distributed
    is initialized, else this process alone, decided when the layer is built). Its size must
    divide ``num_experts``. ``capacity_factor`` sets the slots per expert
    (:func:`engine.theory.expert_capacity`).
    """

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, top_k: int = 2,
                 capacity_factor: float = 1.25, group=None, aux_loss_coef: float = 0.01,
                 z_loss_coef: float = 1e-3):
        super().__init__()
        positive_int("hidden", hidden)
        positive_int("ffn_hidden", ffn_hidden)
        check_routing(num_experts, top_k, capacity_factor)
        rank, n = ep_rank_and_size(group)
        divides("the expert-parallel degree (ranks in group)", n, "num_experts", num_experts)
        self.hidden, self.ffn_hidden, self.num_experts = hidden, ffn_hidden, num_experts
        self.top_k, self.capacity_factor = top_k, capacity_factor
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.group, self.ep_size = group, n
        self.first_expert = rank * (num_experts // n)
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, ffn_hidden) for _ in range(num_experts // n))
        self.aux_loss = self.z_loss = None
        self.stats: MoEStats | None = None

    @classmethod
    def from_dense(cls, moe: "MoE", group=None) -> "MoE":
        """This rank's experts (and a copy of the router) of ``moe``, a layer holding all its
        experts (built on one rank), spread over ``group``."""
        if moe.ep_size != 1:
            raise ValueError(f"from_dense takes a layer holding all its experts; this one is "
                             f"spread over {moe.ep_size} ranks")
        ep = cls(moe.hidden, moe.ffn_hidden, moe.num_experts, moe.top_k, moe.capacity_factor,
                 group, moe.aux_loss_coef, moe.z_loss_coef)
        ep.to(moe.router.weight.device)
        with torch.no_grad():
            ep.router.weight.copy_(moe.router.weight)
            for i, expert in enumerate(ep.experts):
                expert.load_state_dict(moe.experts[ep.first_expert + i].state_dict())
        return ep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, self.hidden)
        logits = self.router(tokens)
        routing = route(logits, self.top_k, self.capacity_factor)
        self.aux_loss = load_balancing_loss(routing.probs, routing.expert, self.aux_loss_coef)
        self.z_loss = router_z_loss(logits, self.z_loss_coef)
        token, choice = routing.keep.nonzero(as_tuple=True)  # kept assignments, (t, j) order
        expert = routing.expert[token, choice]
        y, processed = self._run_experts(tokens[token], expert)
        weighted = y * routing.gate[token, choice].unsqueeze(-1)
        out = tokens.new_zeros(tokens.shape).index_add(0, token, weighted)
        self.stats = MoEStats(routing.demand.tolist(), routing.load.tolist(), routing.capacity,
                              routing.drop_rate, processed)
        return out.view(x.shape)

    def _run_experts(self, rows: torch.Tensor, expert: torch.Tensor
                     ) -> tuple[torch.Tensor, list[int]]:
        """Each row through its expert, wherever that expert lives; the outputs in the rows'
        order, and the rows this rank's experts processed, per expert."""
        if self.ep_size == 1:
            order = torch.argsort(expert, stable=True)
            counts = torch.bincount(expert, minlength=self.num_experts).tolist()
            return self._local(rows[order], counts)[inverse(order)], counts
        arrived, counts, state = dispatch(rows, expert, self.num_experts, self.group)
        return combine(self._local(arrived, counts), state), counts

    def _local(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's experts on their blocks of ``rows`` (block sizes ``counts``)."""
        blocks = rows.split(counts)
        return torch.cat([expert(block) for expert, block in zip(self.experts, blocks,
                                                                  strict=True)])

    def extra_repr(self) -> str:
        return (f"experts {self.first_expert}..{self.first_expert + len(self.experts) - 1} of "
                f"{self.num_experts}, top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor}, ep={self.ep_size}")
