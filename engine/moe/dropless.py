"""Dropless expert computation: every (token, expert) assignment goes to its expert, and each
expert runs once on its whole batch, whatever its size.

With capacity, an expert's batch is at most ``C`` rows and the rest are dropped; without it the
batch of a popular expert may be several times the mean, and its size is only known once the
tokens are routed. Nothing here needs fixed shapes: :func:`engine.moe.dispatch.dispatch`
exchanges the counts first, then sends uneven splits, and each local expert gets one block of
rows of whatever length arrived. That is dropless MoE (Gale et al., "MegaBlocks: efficient
sparse training with mixture-of-experts", MLSys 2023, which computes the variable-size blocks
with block-sparse kernels; Megatron-Core's dropless MoE runs them as a grouped GEMM; DeepSeek-V3
drops no token in training or inference). On a GPU the price is the variable shapes (a
grouped GEMM instead of one batched GEMM, memory sized for the worst expert); on the CPU the
loop over experts below is that grouped GEMM's reference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine.moe.dispatch import combine, dispatch, inverse


def run_experts(rows: torch.Tensor, expert: torch.Tensor, experts: nn.ModuleList | list,
                num_experts: int, group=None) -> tuple[torch.Tensor, list[int]]:
    """Each row of ``rows`` [M, h] through expert ``expert[i]``, wherever it lives (this
    rank holds ``experts``, its ``num_experts / n`` consecutive experts of ``group``); the
    outputs in the rows' order, and the rows each local expert processed."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=num_experts).tolist()
        return local_blocks(rows[order], counts, experts)[inverse(order)], counts
    arrived, counts, state = dispatch(rows, expert, num_experts, group)
    return combine(local_blocks(arrived, counts, experts), state), counts


def local_blocks(rows: torch.Tensor, counts: list[int], experts) -> torch.Tensor:
    """Each local expert once, on its block of ``rows`` (block sizes ``counts``)."""
    blocks = rows.split(counts)
    return torch.cat([expert(block) for expert, block in zip(experts, blocks, strict=True)])


def mix_experts(tokens: torch.Tensor, token: torch.Tensor, expert: torch.Tensor,
                gate: torch.Tensor, experts, num_experts: int, group=None
                ) -> tuple[torch.Tensor, list[int]]:
    """``out[t] = sum over the assignments (t, e, g) of g * expert_e(tokens[t])``, for the
    assignments ``token``, ``expert``, ``gate`` (one entry each); a token with none gets
    zeros. Returns ``out`` and the rows each local expert processed."""
    y, processed = run_experts(tokens[token], expert, experts, num_experts, group)
    # summed in the tokens' dtype: under bf16 autocast the experts' rows come back in bf16
    mixed = (y * gate.unsqueeze(-1)).to(tokens.dtype)
    out = tokens.new_zeros(tokens.shape).index_add(0, token, mixed)
    return out, processed


def dropless_moe(x: torch.Tensor, expert: torch.Tensor, gate: torch.Tensor, experts,
                 num_experts: int, group=None) -> torch.Tensor:
    """The dropless layer's expert part: ``x`` [T, h], every token's ``k`` experts ``expert``
    [T, k] and gates ``gate`` [T, k], this rank's ``experts``. Every assignment is computed:
    ``out[t] = sum_j gate[t, j] * expert_{expert[t, j]}(x[t])``."""
    tokens, top_k = expert.shape
    token = torch.arange(tokens, device=x.device).repeat_interleave(top_k)
    return mix_experts(x, token, expert.reshape(-1), gate.reshape(-1), experts, num_experts,
                       group)[0]
