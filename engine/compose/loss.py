"""The loss: the sum over every token that counts in the global batch, divided by their global
count, whatever dp, cp, pp and the number of micro-batches.

A naive loop takes each micro-batch's mean and averages those means over micro-batches and
ranks. That is the global mean only when every micro-batch holds as many tokens that count; with
padding (or packed documents, or a loss mask) a token in a short micro-batch weighs more than
one in a long one, and the gradients differ from one process's (the bug torchtitan and
torchtune both fixed for gradient accumulation). Here each rank differentiates

    local_sum / global_tokens * replicas

where ``local_sum`` is the sum of its tokens' cross-entropies, ``global_tokens`` the count of
tokens that count in the whole global batch (every rank knows it up front: it has the batch,
:mod:`engine.compose.data`), and ``replicas`` the number of ranks the data-parallel wrapper
*averages* the gradients over (dp x cp): the average of ``replicas`` such gradients is the sum
of the local ones over global_tokens, exactly one process's gradient.

Under tensor parallelism the logits are split over the vocabulary and the cross-entropy is
Megatron's vocab-parallel one (:func:`engine.tp.layers.vocab_parallel_cross_entropy`).

An MoE model's router z-loss is a mean over tokens too, and is normalised the same way (its
sum over the global count of tokens routed); the balancing loss is not a sum over tokens, and
is computed from statistics all-reduced over the ranks (:mod:`engine.compose.experts`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.tp.layers import vocab_parallel_cross_entropy


def token_losses(logits: torch.Tensor, targets: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Each token's cross-entropy, in fp32. ``tp_group``: the logits are this rank's slice of
    the vocabulary over it; ``None``: they are whole (one process)."""
    if tp_group is None:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                               reduction="none").view(targets.shape)
    return vocab_parallel_cross_entropy(logits.float(), targets, tp_group)


def masked_sum(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
               tp_group=None) -> torch.Tensor:
    """The sum of the cross-entropies of the tokens ``mask`` counts."""
    return (token_losses(logits, targets, tp_group) * mask).sum()


def global_token_loss(local_sum: torch.Tensor, global_tokens: int, replicas: int = 1
                      ) -> torch.Tensor:
    """What a rank differentiates (module docstring): exact whatever the layout."""
    if global_tokens < 1:
        raise ValueError(f"the global batch has {global_tokens} tokens that count in the loss; "
                         "at least 1 is needed")
    return local_sum * (replicas / global_tokens)


def micro_batch_mean(local_sum: torch.Tensor, mask: torch.Tensor, micro_batches: int
                     ) -> torch.Tensor:
    """What a naive loop differentiates: this micro-batch's mean over its own tokens, over
    the number of micro-batches. Shown to be wrong with uneven token counts (tests)."""
    return local_sum / mask.sum().clamp(min=1) / micro_batches
