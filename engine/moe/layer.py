"""``MoE``: a mixture-of-experts MLP whose experts are spread over the ranks of a group.

The layer replaces a transformer block's MLP (Shazeer et al. 2017; Lepikhin et al., GShard,
2021; Fedus et al., Switch, 2022). For each token the router picks ``top_k`` experts
(:mod:`engine.moe.router`); the token's rows go to the ranks holding those experts and back
(:mod:`engine.moe.dispatch`); the output is the experts' outputs weighted by the gates. An
assignment over capacity is dropped: the token gets nothing from that expert, and with
nothing from any it leaves the layer as zeros, so ``x + moe(x)`` passes it through.
``capacity_factor=None`` is **dropless**: every assignment is kept and each expert runs once on
its whole batch, whatever its size (MegaBlocks; Megatron-Core; DeepSeek-V3).

**The frontier options** (each off by default, so the layer stays Switch/GShard/Mixtral):

* ``bias_update_rate`` (gamma): aux-loss-free balancing (DeepSeek-V3, section 2.1.2): a
  per-expert bias, a buffer, shifts which experts are chosen, never the gates; call
  :meth:`MoE.update_bias` after each optimizer step (:mod:`engine.moe.balance`);
  ``seq_aux_loss_coef`` adds its sequence-wise balance loss (eq. 17-20) over ``sequences``;
* ``num_shared``: shared experts, run on every token and added to the routed output, no gate
  (DeepSeekMoE, Dai et al. 2024; DeepSeek-V3 has 1); they are dense weights, on every rank;
* fine-grained experts are a configuration, not code: ``m`` times more experts, ``m`` times
  smaller (``ffn_hidden / m``), top ``m k`` (:func:`engine.theory.fine_grained`);
* ``expert_choice=True``: each expert picks its tokens (:mod:`engine.moe.expert_choice`).

**Expert parallelism.** With ``group`` of ``n`` ranks, each rank holds ``E/n`` whole experts
(rank r: experts ``r E/n`` to ``(r+1) E/n - 1``) and a full copy of the router. No expert is
split: an expert is an ordinary MLP, which fits on one GPU, so experts need no tensor
parallelism; what grows with ``E`` is the number of experts, and that is what the ranks split.

**Routing is per rank.** Every rank routes its own tokens: the capacity, the drops and the
balancing loss are computed over the tokens the layer sees in one call on one rank (GShard's
"groups"). So expert parallelism over ``n`` ranks equals one process running the same layer
once on each rank's tokens, which is what the tests check.

The layer keeps its last ``aux_loss`` (Switch's load-balancing loss, times
``aux_loss_coef``, plus the sequence-wise loss), ``z_loss`` (ST-MoE's router z-loss, times ``z_loss_coef``) and ``stats``
(:class:`MoEStats`): add the two losses to the training loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.comm import ops
from engine.moe import balance
from engine.moe.dropless import mix_experts
from engine.moe.expert_choice import expert_choice_route
from engine.moe.router import (check_routing, load_balancing_loss, route, router_z_loss,
                               sequence_balance_loss)
from engine.validation import divides, positive_int, positive_number


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
    capacity: int | None  # slots per expert for this rank's tokens (None: dropless)
    drop_rate: float  # dropped / all assignments of this rank's tokens
    processed: list[int]  # rows this rank's experts processed (from every rank), per expert
    unrouted: float = 0.0  # the share of this rank's tokens that reached no expert


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


OPTION_DEFAULTS = dict(bias_update_rate=None, seq_aux_loss_coef=0.0, sequences=1, num_shared=0,
                       expert_choice=False)


class MoE(nn.Module):
    """``top_k`` of ``num_experts`` experts per token, experts spread over ``group``.

    ``group``: the expert-parallel group (``None``: the default group when torch.distributed
    is initialized, else this process alone, decided when the layer is built). Its size must
    divide ``num_experts``. ``capacity_factor`` sets the slots per expert
    (:func:`engine.theory.expert_capacity`); ``None`` drops nothing. The other options are in
    the module docstring.
    """

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, top_k: int = 2,
                 capacity_factor: float | None = 1.25, group=None, aux_loss_coef: float = 0.01,
                 z_loss_coef: float = 1e-3, *, bias_update_rate: float | None = None,
                 seq_aux_loss_coef: float = 0.0, sequences: int = 1, num_shared: int = 0,
                 expert_choice: bool = False):
        super().__init__()
        positive_int("hidden", hidden)
        positive_int("ffn_hidden", ffn_hidden)
        check_routing(num_experts, top_k, capacity_factor)
        if expert_choice and capacity_factor is None:
            raise ValueError("expert_choice needs a capacity_factor (the experts per token on "
                             "average), got None")
        if bias_update_rate is not None:
            positive_number("bias_update_rate", bias_update_rate)
        positive_int("sequences", sequences)
        if num_shared < 0:
            raise ValueError(f"num_shared must be 0 or more, got {num_shared!r}")
        rank, n = ep_rank_and_size(group)
        divides("the expert-parallel degree (ranks in group)", n, "num_experts", num_experts)
        self.hidden, self.ffn_hidden, self.num_experts = hidden, ffn_hidden, num_experts
        self.top_k, self.capacity_factor = top_k, capacity_factor
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.options = dict(bias_update_rate=bias_update_rate,
                            seq_aux_loss_coef=seq_aux_loss_coef, sequences=sequences,
                            num_shared=num_shared, expert_choice=expert_choice)
        self.group, self.ep_size = group, n
        self.first_expert = rank * (num_experts // n)
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, ffn_hidden) for _ in range(num_experts // n))
        self.shared = nn.ModuleList(Expert(hidden, ffn_hidden) for _ in range(num_shared))
        if bias_update_rate is not None:
            self.register_buffer("expert_bias", torch.zeros(num_experts))
            self.register_buffer("pending_load", torch.zeros(num_experts, dtype=torch.long))
        else:
            self.expert_bias = None
        self.aux_loss = self.z_loss = None
        self.stats: MoEStats | None = None

    @classmethod
    def from_dense(cls, moe: "MoE", group=None) -> "MoE":
        """This rank's experts (and a copy of the router, the shared experts and the biases)
        of ``moe``, a layer holding all its experts (built on one rank), spread over
        ``group``."""
        if moe.ep_size != 1:
            raise ValueError(f"from_dense takes a layer holding all its experts; this one is "
                             f"spread over {moe.ep_size} ranks")
        ep = cls(moe.hidden, moe.ffn_hidden, moe.num_experts, moe.top_k, moe.capacity_factor,
                 group, moe.aux_loss_coef, moe.z_loss_coef, **moe.options)
        ep.to(moe.router.weight.device)
        with torch.no_grad():
            ep.router.weight.copy_(moe.router.weight)
            for i, expert in enumerate(ep.experts):
                expert.load_state_dict(moe.experts[ep.first_expert + i].state_dict())
            ep.shared.load_state_dict(moe.shared.state_dict())
            if moe.expert_bias is not None:
                ep.expert_bias.copy_(moe.expert_bias)
                ep.pending_load.copy_(moe.pending_load)
        return ep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, self.hidden)
        logits = self.router(tokens)
        self.z_loss = router_z_loss(logits, self.z_loss_coef)
        if self.options["expert_choice"]:
            token, expert, gate = self._experts_choose(logits)
        else:
            token, expert, gate = self._tokens_choose(logits)
        out, processed = mix_experts(tokens, token, expert, gate, self.experts,
                                     self.num_experts, self.group)
        for shared in self.shared:
            out = out + shared(tokens)
        self.stats.processed = processed
        return out.view(x.shape)

    def _tokens_choose(self, logits: torch.Tensor):
        """Top-k routing: the kept (token, expert, gate) assignments, in (token, choice)
        order; sets the losses and the stats."""
        routing = route(logits, self.top_k, self.capacity_factor, self.expert_bias)
        self.aux_loss = load_balancing_loss(routing.probs, routing.expert, self.aux_loss_coef)
        if self.options["seq_aux_loss_coef"]:
            self.aux_loss = self.aux_loss + sequence_balance_loss(
                routing.probs, routing.expert, self.options["seq_aux_loss_coef"],
                self.options["sequences"])
        if self.expert_bias is not None and self.training:
            self.pending_load += routing.demand
        token, choice = routing.keep.nonzero(as_tuple=True)  # kept assignments, (t, j) order
        reached = torch.zeros(len(logits), dtype=torch.bool, device=logits.device).index_fill(0, token, True)
        self.stats = MoEStats(routing.demand.tolist(), routing.load.tolist(), routing.capacity,
                              routing.drop_rate, [], float((~reached).float().mean()))
        return token, routing.expert[token, choice], routing.gate[token, choice]

    def _experts_choose(self, logits: torch.Tensor):
        """Expert-choice routing: every expert's ``c`` tokens, in (expert, rank) order."""
        choice = expert_choice_route(logits, self.capacity_factor)
        per_expert = choice.token.shape[1]
        self.aux_loss = logits.new_zeros(())  # balanced by construction
        load = [per_expert] * self.num_experts
        self.stats = MoEStats(load, load, per_expert, 0.0, [], choice.unrouted)
        expert = torch.arange(self.num_experts, device=logits.device).repeat_interleave(per_expert)
        return choice.token.reshape(-1), expert, choice.gate.reshape(-1)

    @torch.no_grad()
    def update_bias(self, group="experts") -> torch.Tensor:
        """Aux-loss-free balancing: move every expert's bias by ``gamma`` towards balance
        (:func:`engine.moe.balance.update_bias`), from the assignments counted since the
        last update, summed over ``group`` (default: this layer's expert-parallel group; pass
        every rank that routes with these biases, e.g. ``mesh.dp_cp_group`` of an
        :class:`engine.topology.Mesh`). Call it
        after each optimizer step; returns the load it used."""
        if self.expert_bias is None:
            raise ValueError("update_bias needs a layer built with bias_update_rate (gamma)")
        load = self.pending_load.clone()
        if group == "experts":
            group = self.group if self.ep_size > 1 else "none"
        if group != "none":
            ops.all_reduce(load, group=group)
        self.expert_bias.copy_(balance.update_bias(self.expert_bias, load,
                                                   self.options["bias_update_rate"]))
        self.pending_load.zero_()
        return load

    def extra_repr(self) -> str:
        options = "".join(f", {k}={v}" for k, v in self.options.items()
                          if v != OPTION_DEFAULTS[k])
        return (f"experts {self.first_expert}..{self.first_expert + len(self.experts) - 1} of "
                f"{self.num_experts}, top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor}, ep={self.ep_size}{options}")
