"""A tiny GPT whose MLPs are mixture-of-experts layers (the shape of Switch, GShard, Mixtral).

``TinyMoEGPT`` is :class:`engine.models.TinyGPT` (same attention, norms, embeddings and
initialisation) with each block's MLP replaced by an :class:`engine.moe.MoE`. Its ``loss``
adds every layer's load-balancing loss and router z-loss to the cross-entropy.
:func:`expert_parallel` turns a model built on one rank into this rank's share of it: the same
dense weights, and this rank's experts of every MoE layer.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from engine.models import Block, GPTConfig, TinyGPT, gpt2_init, seeded
from engine.moe.layer import MoE

TINY_MOE = dict(num_experts=4, top_k=2, capacity_factor=1.25)
MOE_MODELS = {"tiny-moe": TINY_MOE}  # python -m engine train --model NAME: the MoE settings


class MoEBlock(nn.Module):
    """A pre-LayerNorm block with an MoE layer where the MLP was: ``x + moe(ln2(x))``."""

    def __init__(self, block: Block, moe: MoE):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.moe = block.ln1, block.attn, block.ln2, moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class TinyMoEGPT(TinyGPT):
    """:class:`TinyGPT` with MoE MLPs of ``num_experts`` experts of ``ffn_hidden`` (default
    ``4 hidden``, the dense MLP's size) each, spread over ``group``."""

    def __init__(self, cfg: GPTConfig = GPTConfig(), num_experts: int = 4, top_k: int = 2,
                 capacity_factor: float = 1.25, ffn_hidden: int | None = None, seed: int = 0,
                 group=None, aux_loss_coef: float = 0.01, z_loss_coef: float = 1e-3):
        super().__init__(cfg, seed)
        ffn = 4 * cfg.hidden if ffn_hidden is None else ffn_hidden
        with seeded(seed + 1):
            moes = [MoE(cfg.hidden, ffn, num_experts, top_k, capacity_factor, group,
                        aux_loss_coef, z_loss_coef) for _ in self.blocks]
            for moe in moes:
                moe.apply(gpt2_init)
        self.blocks = nn.ModuleList(MoEBlock(b, m) for b, m in zip(self.blocks, moes))

    def moe_layers(self) -> list[MoE]:
        return [block.moe for block in self.blocks]

    def router_losses(self) -> torch.Tensor:
        """The sum of every layer's balancing loss and z-loss from the last forward."""
        return sum(m.aux_loss + m.z_loss for m in self.moe_layers())

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return super().loss(idx, targets) + self.router_losses()


def expert_parallel(model: nn.Module, group=None) -> nn.Module:
    """A copy of ``model`` (whose MoE layers hold all their experts) in which every MoE layer
    keeps only this rank's experts of ``group`` (:meth:`MoE.from_dense`)."""
    groups = {id(m.group): m.group for m in model.modules() if isinstance(m, MoE)}
    model = copy.deepcopy(model, memo=groups)  # process groups are shared, not copied
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, MoE):
                setattr(parent, name, MoE.from_dense(child, group))
    return model


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of every expert of every MoE layer (not the routers)."""
    return [p for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters()]
