"""A tiny GPT whose MLPs are mixture-of-experts layers (the shape of Switch, GShard, Mixtral).

``TinyMoEGPT`` is :class:`engine.model.gpt.TinyGPT` (same attention, norms, embeddings and
initialisation) with each block's MLP replaced by an :class:`engine.moe.MoE`: the one GPT
definition given the MoE layers as its ``feed_forward`` (blocks ``ln1``, ``attn``, ``ln2``,
``moe``). Its ``loss`` adds every layer's load-balancing loss and router z-loss to the
cross-entropy. :func:`expert_parallel` turns a model built on one rank into this rank's share
of it: the same dense weights, and this rank's experts of every MoE layer.
"""

from __future__ import annotations

import copy
from typing import Callable

from torch import nn

from engine.model.gpt import GPTConfig, TinyGPT, gpt2_init
from engine.moe.layer import MoE

TINY_MOE = dict(num_experts=4, top_k=2, capacity_factor=1.25)
MOE_MODELS = {"tiny-moe": TINY_MOE}  # python -m engine train --model NAME: the MoE settings


def moe_feed_forward(hidden: int, ffn_hidden: int, num_experts: int, top_k: int = 2,
                     capacity_factor: float | None = 1.25, group=None,
                     aux_loss_coef: float = 0.01, z_loss_coef: float = 1e-3, **options
                     ) -> Callable[[int], list[MoE]]:
    """The ``feed_forward`` of an MoE :class:`engine.model.gpt.GPT`: given the number of blocks,
    one :class:`MoE` per block (``options``: its frontier options), each drawn and then given
    GPT-2's initialisation before the next is drawn. The one order every MoE GPT of the engine
    draws its experts in (:class:`TinyMoEGPT`, :class:`engine.compose.model.GPT`), so the same
    seed gives both the same experts (tests/test_moe.py)."""

    def layers(blocks: int) -> list[MoE]:
        return [MoE(hidden, ffn_hidden, num_experts, top_k, capacity_factor, group,
                    aux_loss_coef, z_loss_coef, **options).apply(gpt2_init)
                for _ in range(blocks)]

    return layers


class TinyMoEGPT(TinyGPT):
    """:class:`TinyGPT` with MoE MLPs of ``num_experts`` experts of ``ffn_hidden`` (default
    ``4 hidden``, the dense MLP's size) each, spread over ``group``. The experts are drawn
    under the seed ``seed + 1``, in the order of :func:`moe_feed_forward`."""

    def __init__(self, cfg: GPTConfig = GPTConfig(), num_experts: int = 4, top_k: int = 2,
                 capacity_factor: float = 1.25, ffn_hidden: int | None = None, seed: int = 0,
                 group=None, aux_loss_coef: float = 0.01, z_loss_coef: float = 1e-3):
        ffn = 4 * cfg.hidden if ffn_hidden is None else ffn_hidden
        super().__init__(cfg, seed, feed_forward=moe_feed_forward(
            cfg.hidden, ffn, num_experts, top_k, capacity_factor, group, aux_loss_coef,
            z_loss_coef))


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
