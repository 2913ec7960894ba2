"""``GPT``: the one GPT definition (:class:`engine.model.gpt.GPT`) with its MoE layers built from
the configuration, for the composed engine.

:class:`engine.model.gpt.GPT` holds the model: grouped-query attention (``kv_heads``), tied or
untied embeddings, ``qkv_bias``, ``ffn_hidden``, the positions argument a context-parallel
rank needs. This module adds what lives above the foundation layer:

* the **mixture-of-experts** numbers in :class:`ModelConfig` (``num_experts > 0``: every
  block's MLP is an :class:`engine.moe.MoE` (:func:`engine.moe.gpt.moe_feed_forward`); with
  Switch's balancing loss, ST-MoE's z-loss and optionally DeepSeek-V3's aux-loss-free bias),
  given to the one GPT as its ``feed_forward``;
* the scatter of the positions under **sequence parallelism** (:mod:`engine.tp.mappings`).

With ``kv_heads = heads``, ``tied=True`` and no experts, ``GPT(cfg, seed)`` has the same
parameters, names and bits as :class:`engine.model.gpt.TinyGPT` (tests/test_compose.py).

The parallel layouts change modules, not this file:
:func:`engine.compose.parallelize.parallelize` replaces the linear layers, the embedding and
the LayerNorms by their tensor-parallel forms, sets each attention's ``core`` (ring or Ulysses
under context parallelism) and, with sequence parallelism, ``sp_group``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from engine.model.gpt import GPT as OneGPT
from engine.model.gpt import Attention, Block, GPTConfig, grouped_causal_attention
from engine.moe.gpt import moe_feed_forward
from engine.tp.mappings import scatter_to_sequence_parallel
from engine.validation import non_negative_int, positive_int

__all__ = ["ModelConfig", "GPT", "Attention", "Block", "grouped_causal_attention"]


@dataclass(frozen=True)
class ModelConfig(GPTConfig):
    """:class:`engine.model.gpt.GPTConfig` (sizes, ``kv_heads``, ``tied``, ``qkv_bias``,
    ``ffn_hidden``) with 4 heads by default, and the mixture-of-experts numbers."""

    heads: int = 4
    num_experts: int = 0  # 0: dense feed-forward layers
    top_k: int = 2
    capacity_factor: float = 1.25
    # Switch's load-balancing loss and ST-MoE's router z-loss, each over the global
    # micro-batch under a parallel layout (engine.compose.experts.balance_globally)
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 1e-3
    bias_update_rate: float | None = None  # DeepSeek-V3's aux-loss-free bias (gamma)

    def __post_init__(self):
        super().__post_init__()
        positive_int("ModelConfig.top_k", self.top_k)
        non_negative_int("ModelConfig.num_experts", self.num_experts)

    @classmethod
    def from_gpt(cls, cfg: GPTConfig, **choices) -> "ModelConfig":
        """``cfg``'s sizes and choices (a :class:`engine.model.gpt.GPTConfig`), with
        ``choices`` over them."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(GPTConfig)} | choices)


class GPT(OneGPT):
    """:class:`engine.model.gpt.GPT` of ``cfg``, its MoE layers (``cfg.num_experts > 0``) built
    over ``expert_group`` (:class:`engine.moe.MoE`'s ``group``). Inside launched ranks pass a
    one-rank group (:func:`engine.moe.layer.single_rank_group`): every rank then builds every
    expert, from the same seed, and expert parallelism keeps its share
    (:mod:`engine.compose.experts`)."""

    def __init__(self, cfg: ModelConfig = ModelConfig(), seed: int = 0, expert_group=None,
                 checkpoint: bool = False):
        experts = moe_feed_forward(cfg.hidden, cfg.ffn, cfg.num_experts, cfg.top_k,
                                   cfg.capacity_factor, expert_group, cfg.aux_loss_coef,
                                   cfg.z_loss_coef, bias_update_rate=cfg.bias_update_rate)
        super().__init__(cfg, seed, checkpoint, experts if cfg.num_experts else None)

    def scatter_positions(self, pos: torch.Tensor, group) -> torch.Tensor:
        """This rank's ``s/t`` positions, as its tokens (sequence parallelism)."""
        return scatter_to_sequence_parallel(pos, group, dim=0)
