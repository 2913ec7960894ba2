"""The mixture-of-experts layers of an MoE GPT (the shape of Switch, GShard, Mixtral), and the
MoE models ``python -m engine train --model NAME`` builds.

:func:`moe_feed_forward` is the ``feed_forward`` the one GPT (:class:`engine.model.gpt.GPT`)
takes: each block's MLP replaced by an :class:`engine.moe.MoE` (blocks ``ln1``, ``attn``,
``ln2``, ``moe``). :class:`engine.compose.model.GPT` builds it from its configuration, and
:func:`engine.compose.parallelize.parallelize` spreads its experts (expert parallelism,
:mod:`engine.compose.experts`).
"""

from __future__ import annotations

from typing import Callable

from engine.model.gpt import gpt2_init
from engine.moe.layer import MoE

TINY_MOE = dict(num_experts=4, top_k=2, capacity_factor=1.25)
MOE_MODELS = {"tiny-moe": TINY_MOE}  # python -m engine train --model NAME: the MoE settings


def moe_feed_forward(hidden: int, ffn_hidden: int, num_experts: int, top_k: int = 2,
                     capacity_factor: float | None = 1.25, group=None,
                     aux_loss_coef: float = 0.01, z_loss_coef: float = 1e-3, **options
                     ) -> Callable[[int], list[MoE]]:
    """The ``feed_forward`` of an MoE :class:`engine.model.gpt.GPT`: given the number of blocks,
    one :class:`MoE` per block (``options``: its frontier options) over ``group``, each drawn
    and then given GPT-2's initialisation before the next is drawn."""

    def layers(blocks: int) -> list[MoE]:
        return [MoE(hidden, ffn_hidden, num_experts, top_k, capacity_factor, group,
                    aux_loss_coef, z_loss_coef, **options).apply(gpt2_init)
                for _ in range(blocks)]

    return layers
