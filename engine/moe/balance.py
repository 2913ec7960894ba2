"""Balancing the experts' load without (much of) a loss: DeepSeek-V3's per-expert bias, its
sequence-wise balance loss, and MaxVio, the measure of imbalance.

The router (:mod:`engine.moe.router`) builds on this module.

**Aux-loss-free balancing** (Wang et al., "Auxiliary-loss-free load balancing strategy for
mixture-of-experts", 2024; DeepSeek-AI, "DeepSeek-V3 technical report", 2024, section 2.1.2).
Each expert i has a bias ``b_i``, added to its routing score **only to choose** the top-k
experts; the gate that weights the expert's output is computed from the unbiased scores
(:func:`biased_top_k`). After each training step, every bias moves by a fixed step ``gamma``
towards balance (:func:`update_bias`)::

    b_i <- b_i + gamma * sign(mean_j load_j - load_i)

an overloaded expert's bias falls, an idle one's rises. The bias is not a parameter: no
gradient reaches it, so balancing does not pull the router's weights away from the task, which
is what a balancing loss does. DeepSeek-V3 uses gamma = 0.001 (for most of training).

**Sequence-wise balance loss** (DeepSeek-V3, eq. 17-20): the Switch loss computed over each
sequence's tokens (not the batch's), with a tiny coefficient, against one sequence sending
everything to the same experts. With the router's softmax as the normalised score this is
:func:`engine.moe.router.sequence_balance_loss`.

**MaxVio** (Wang et al. 2024, eq. 4): ``max_i load_i / mean_i load_i - 1``; 0 is perfect
balance, 1 means the busiest expert does twice the average work (and, under expert
parallelism, its rank runs twice as long): :func:`engine.theory.max_violation`.
"""

from __future__ import annotations

import torch

DEEPSEEK_V3_GAMMA = 0.001  # the bias update speed (DeepSeek-V3, section 4.2)


def update_bias(bias: torch.Tensor, load: torch.Tensor, gamma: float = DEEPSEEK_V3_GAMMA
                ) -> torch.Tensor:
    """The biases after one step: ``bias + gamma * sign(load.mean() - load)``.

    ``load`` [E]: the assignments each expert received in the step (over every rank routing
    with the same biases). Only the sign of the error counts: the step is ``gamma`` whatever
    the size of the imbalance, and an expert exactly at the mean keeps its bias."""
    load = load.to(bias.dtype)
    return bias + gamma * torch.sign(load.mean() - load)


def biased_top_k(probs: torch.Tensor, bias: torch.Tensor | None, top_k: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(expert, gate)`` [T, k]: the top-k experts of ``probs + bias`` (most preferred first),
    and their gates from the **unbiased** ``probs`` (renormalised over the k when k > 1, as
    :func:`engine.moe.router.route` does). ``bias=None`` is plain top-k."""
    chooser = probs.detach() if bias is None else probs.detach() + bias
    expert = chooser.topk(top_k, dim=-1).indices
    top = probs.gather(-1, expert)
    gate = top / top.sum(dim=-1, keepdim=True) if top_k > 1 else top
    return expert, gate

