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
so the block's residual connection carries it through unchanged. Capacity bounds the work
(and the buffers) of the busiest expert; the shapes need not be fixed, since the dispatch
exchanges counts first and sends uneven splits (:mod:`engine.moe.dispatch`).

**Dropless** (``capacity_factor=None``): every assignment is kept, and each expert runs on
however many rows it received, as GPU MoE training usually does (Gale et al., "MegaBlocks",
MLSys 2023; Megatron-Core's dropless MoE; DeepSeek-V3, section 2.1.2: it "does not drop any
tokens").

**Aux-loss-free bias** (``bias``): added to the probabilities only to choose the experts, the
gates stay unbiased (:mod:`engine.moe.balance`, DeepSeek-V3 section 2.1.2).

**Losses.** The load-balancing loss (Switch, eq. 4) is ``alpha E sum_i f_i P_i``: ``f_i`` the
fraction of assignments routed to expert i, ``P_i`` the mean router probability of expert i.
Only ``P`` carries a gradient. It equals ``alpha`` when both are uniform, but uniform is not
its minimum: it is a heuristic whose gradient pushes probability away from busy experts
(two experts, three top-1 tokens with probabilities (0.51, 0.49), (0.51, 0.49), (0, 1) give
``0.893 alpha``: f = (2/3, 1/3), P = (0.34, 0.66)). DeepSeek-V3's sequence-wise variant
(eq. 17-20) is the same loss per sequence (:func:`sequence_balance_loss`). The router z-loss
(Zoph et al., "ST-MoE", 2022, eq. 5) is the mean squared log-sum-exp of the logits: it keeps
them small, where the softmax is numerically tame.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import theory
from engine.moe.balance import biased_top_k
from engine.validation import positive_int, positive_number


def check_routing(num_experts: int, top_k: int, capacity_factor: float | None) -> None:
    """A ValueError naming the bad value, for any argument the router cannot work with
    (``capacity_factor=None``: dropless)."""
    positive_int("num_experts", num_experts)
    positive_int("top_k", top_k)
    if top_k > num_experts:
        raise ValueError(f"top_k = {top_k} is larger than num_experts = {num_experts}: a token "
                         "cannot go to more experts than there are")
    if capacity_factor is not None:
        positive_number("capacity_factor", capacity_factor)


@dataclass
class Routing:
    """Where the ``T`` tokens of one batch go. Row t, column j is token t's j-th choice."""

    expert: torch.Tensor  # [T, k] int64: the chosen experts, most probable first
    gate: torch.Tensor  # [T, k]: the weights of their outputs (differentiable)
    keep: torch.Tensor  # [T, k] bool: the assignment got a slot (False: dropped)
    slot: torch.Tensor  # [T, k] int64: its place in the expert's queue, in priority order
    probs: torch.Tensor  # [T, E]: the router's softmax (differentiable)
    capacity: int | None  # slots per expert (None: dropless, no limit)

    @property
    def num_experts(self) -> int:
        return self.probs.shape[-1]

    @property
    def demand(self) -> torch.Tensor:
        """[E]: assignments routed to each expert, before capacity."""
        return torch.bincount(self.expert.reshape(-1), minlength=self.num_experts)

    @property
    def load(self) -> torch.Tensor:
        """[E]: assignments each expert processes (at most ``capacity``, if any)."""
        return torch.bincount(self.expert[self.keep], minlength=self.num_experts)

    @property
    def dropped(self) -> int:
        return int((~self.keep).sum())

    @property
    def drop_rate(self) -> float:
        """The fraction of (token, expert) assignments dropped for lack of capacity."""
        return self.dropped / max(self.keep.numel(), 1)


def route(logits: torch.Tensor, top_k: int, capacity_factor: float | None,
          bias: torch.Tensor | None = None) -> Routing:
    """Route ``T`` tokens from their router logits ``[T, E]`` (see the module docstring).
    ``capacity_factor=None`` drops nothing; ``bias`` [E] shifts the choice, not the gates."""
    tokens, num_experts = logits.shape
    check_routing(num_experts, top_k, capacity_factor)
    probs = logits.softmax(dim=-1)
    expert, gate = biased_top_k(probs, bias, top_k)
    # Priority order: all first choices (token order), then all second choices, ...
    in_priority_order = expert.T.reshape(-1)
    claimed = F.one_hot(in_priority_order, num_experts).cumsum(dim=0)
    slot = claimed.gather(1, in_priority_order[:, None]).squeeze(1) - 1
    slot = slot.view(top_k, tokens).T
    if capacity_factor is None:
        return Routing(expert, gate, torch.ones_like(slot, dtype=torch.bool), slot, probs, None)
    capacity = theory.expert_capacity(tokens, num_experts, top_k, capacity_factor)
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


def sequence_balance_loss(probs: torch.Tensor, expert: torch.Tensor, alpha: float,
                          sequences: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (eq. 17-20): :func:`load_balancing_loss` over
    each of ``sequences`` equal runs of consecutive tokens of ``probs`` [T, E] and ``expert``
    [T, k], averaged over the sequences. DeepSeek-V3 keeps ``alpha`` tiny (1e-4) beside its
    bias. ``sequences = 1`` is the Switch loss over all T tokens."""
    tokens = probs.shape[0]
    if sequences < 1 or tokens % sequences:
        raise ValueError(f"sequences = {sequences} must be a positive divisor of the {tokens} "
                         "tokens routed together")
    per = [load_balancing_loss(p, e, alpha)
           for p, e in zip(probs.chunk(sequences), expert.chunk(sequences))]
    return torch.stack(per).mean()
