"""Expert-choice routing: each expert picks its tokens, instead of each token its experts.

Zhou et al., "Mixture-of-experts with expert choice routing" (NeurIPS 2022), section 3.1: with
``S = softmax(logits)`` [T, E] the token-to-expert scores, expert i takes the ``c`` tokens of
highest score in its column, ``G, I = TopK(S^T, c)``, and weights its output for token t by
``S[t, i]``. ``c = ceil(T capacity_factor / E)`` (:func:`engine.theory.expert_capacity` with
k = 1), so ``capacity_factor`` is the number of experts a token gets on average (2: as much
work as top-2).

Every expert processes exactly ``c`` tokens: the load is perfectly balanced by construction, no
balancing loss is needed, and nothing is dropped for lack of room. What changes instead is the
number of experts per token: a hard token may get several, an easy one none (it rides the
residual). The choice looks at every token of the batch at once, future tokens included, so a
decoder cannot route this way token by token at generation time (the paper's limitation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import theory
from engine.validation import positive_int, positive_number


@dataclass
class ExpertChoice:
    """The tokens each expert chose. Row i is expert i's choice, highest score first."""

    token: torch.Tensor  # [E, c] int64
    gate: torch.Tensor  # [E, c]: S[token, i] (differentiable)
    probs: torch.Tensor  # [T, E]: the softmax scores

    @property
    def experts_per_token(self) -> torch.Tensor:
        """[T]: how many experts chose each token (0 to E)."""
        return torch.bincount(self.token.reshape(-1), minlength=self.probs.shape[0])

    @property
    def unrouted(self) -> float:
        """The fraction of tokens no expert chose (they leave the layer as zeros)."""
        return float((self.experts_per_token == 0).float().mean())


def expert_choice_route(logits: torch.Tensor, capacity_factor: float) -> ExpertChoice:
    """Each of the ``E`` experts picks its ``c`` best tokens of the ``T`` in ``logits`` [T, E]
    (see the module docstring)."""
    tokens, num_experts = logits.shape
    positive_int("num_experts", num_experts)
    positive_number("capacity_factor", capacity_factor)
    per_expert = min(tokens, theory.expert_capacity(tokens, num_experts, 1, capacity_factor))
    probs = logits.softmax(dim=-1)
    gate, token = probs.T.topk(per_expert, dim=-1)
    return ExpertChoice(token, gate, probs)
