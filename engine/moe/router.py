"""The top-k router: which experts each token goes to, with what weight, and which of those
assignments fit in the experts' capacity.

A router is one linear layer ``h -> E`` and a softmax (Shazeer et al., "Outrageously large
neural networks", ICLR 2017). Each token goes to the ``k`` experts of highest probability:
k = 1 in Switch (Fedus et al., JMLR 2022), k = 2 in GShard and Mixtral. With k = 1 the gate is
the probability itself, so the router learns through it; with k > 1 the k probabilities are
renormalised to sum to 1 (GShard, Mixtral).

**Capacity.** Each expert has ``C = ceil(T k capacity_factor / E)`` slots for the ``T`` tokens
routed together (:func:`engine.theory.expert_capacity`). Assignments claim slots in a fixed
priority order: every token's first choice, in token order, then every second choice, and so
on (GShard, section 2.2). An assignment that finds its expert full is **dropped**: it
contributes nothing, and a token whose every assignment is dropped leaves the layer as zeros,
so the block's residual connection carries it through unchanged.

**Losses.** The load-balancing loss (Switch, eq. 4) is ``alpha E sum_i f_i P_i``: ``f_i`` the
fraction of assignments routed to expert i, ``P_i`` the mean router probability of expert i.
Only ``P`` carries a gradient; the loss is smallest, ``alpha``, when both are uniform. The
router z-loss (Zoph et al., "ST-MoE", 2022, eq. 5) is the mean squared log-sum-exp of the
logits: it keeps them small, where the softmax is numerically tame.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import theory
from engine.validation import positive_int, positive_number


def check_routing(num_experts: int, top_k: int, capacity_factor: float) -> None:
    """A ValueError naming the bad value, for any argument the router cannot work with."""
    positive_int("num_experts", num_experts)
    positive_int("top_k", top_k)
    if top_k > num_experts:
        raise ValueError(f"top_k = {top_k} is larger than num_experts = {num_experts}: a token "
                         "cannot go to more experts than there are")
    positive_number("capacity_factor", capacity_factor)


@dataclass
class Routing:
    """Where the ``T`` tokens of one batch go. Row t, column j is token t's j-th choice."""

    expert: torch.Tensor  # [T, k] int64: the chosen experts, most probable first
    gate: torch.Tensor  # [T, k]: the weights of their outputs (differentiable)
    keep: torch.Tensor  # [T, k] bool: the assignment got a slot (False: dropped)
    slot: torch.Tensor  # [T, k] int64: its place in the expert's queue, in priority order
    probs: torch.Tensor  # [T, E]: the router's softmax (differentiable)
    capacity: int  # slots per expert

    @property
    def num_experts(self) -> int:
        return self.probs.shape[-1]

    @property
    def demand(self) -> torch.Tensor:
        """[E]: assignments routed to each expert, before capacity."""
        return torch.bincount(self.expert.reshape(-1), minlength=self.num_experts)

    @property
    def load(self) -> torch.Tensor:
        """[E]: assignments each expert processes (at most ``capacity``)."""
        return torch.bincount(self.expert[self.keep], minlength=self.num_experts)

    @property
    def dropped(self) -> int:
        return int((~self.keep).sum())

    @property
    def drop_rate(self) -> float:
        """The fraction of (token, expert) assignments dropped for lack of capacity."""
        return self.dropped / max(self.keep.numel(), 1)


def route(logits: torch.Tensor, top_k: int, capacity_factor: float) -> Routing:
    """Route ``T`` tokens from their router logits ``[T, E]`` (see the module docstring)."""
    tokens, num_experts = logits.shape
    check_routing(num_experts, top_k, capacity_factor)
    probs = logits.softmax(dim=-1)
    top, expert = probs.topk(top_k, dim=-1)
    gate = top / top.sum(dim=-1, keepdim=True) if top_k > 1 else top
    capacity = theory.expert_capacity(tokens, num_experts, top_k, capacity_factor)
    # Priority order: all first choices (token order), then all second choices, ...
    in_priority_order = expert.T.reshape(-1)
    claimed = F.one_hot(in_priority_order, num_experts).cumsum(dim=0)
    slot = claimed.gather(1, in_priority_order[:, None]).squeeze(1) - 1
    slot = slot.view(top_k, tokens).T
    return Routing(expert, gate, slot < capacity, slot, probs, capacity)


def load_balancing_loss(probs: torch.Tensor, expert: torch.Tensor, alpha: float = 0.01
                        ) -> torch.Tensor:
    """Switch Transformers' auxiliary loss (eq. 4): ``alpha E sum_i f_i P_i``.

    ``probs`` [T, E] is the router's softmax, ``expert`` [T, k] the chosen experts. ``f_i``,
    the fraction of the ``T k`` assignments that chose expert i (before capacity), is a count
    and carries no gradient; ``P_i``, the mean of ``probs[:, i]``, does. Dividing by ``T k``
    (not ``T``) makes the balanced value ``alpha`` for every k.
    """
    num_experts = probs.shape[-1]
    f = torch.bincount(expert.reshape(-1), minlength=num_experts).to(probs.dtype)
    f = f / expert.numel()
    return alpha * num_experts * (f * probs.mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor, coef: float = 1e-3) -> torch.Tensor:
    """ST-MoE's router z-loss (eq. 5): ``coef * mean_t (log sum_i exp logits[t, i])^2``."""
    return coef * logits.logsumexp(dim=-1).square().mean()
