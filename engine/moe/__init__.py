"""Mixture of experts and expert parallelism (chapter 10).

:mod:`~engine.moe.router` picks each token's experts and enforces their capacity (or drops
nothing: ``capacity_factor=None``); :mod:`~engine.moe.balance` holds DeepSeek-V3's
aux-loss-free bias; :mod:`~engine.moe.expert_choice` lets each expert pick its tokens;
:mod:`~engine.moe.dispatch` sends tokens to the ranks holding their experts and back with two
all-to-alls; :class:`MoE` is the layer; :mod:`~engine.moe.gpt` gives it to the one GPT as its
feed-forward layers (the expert x data-parallel layout and which group reduces which gradient:
:mod:`engine.compose.experts`, applied by :func:`engine.compose.parallelize.parallelize`); at
inference, :mod:`~engine.moe.redundant` places redundant copies of the hottest experts
(DeepSeek-V3, section 3.4). The load and drop measurements are :mod:`engine.labs.moe`, and why
serving drops no token :mod:`engine.labs.moe_serving`.
"""

from engine.moe.balance import biased_top_k, update_bias
from engine.moe.dispatch import DispatchState, all_to_all, combine, dispatch, exchange_counts
from engine.moe.layer import Expert, MoE, MoEStats, single_rank_group
from engine.moe.expert_choice import ExpertChoice, expert_choice_route
from engine.moe.redundant import Placement, place_experts, redundancy_table, static_placement
from engine.moe.router import (Routing, load_balancing_loss, route, router_z_loss,
                               sequence_balance_loss)

__all__ = ["MoE", "Expert", "MoEStats", "single_rank_group", "Routing", "route",
           "load_balancing_loss", "router_z_loss", "dispatch", "combine", "DispatchState",
           "all_to_all", "exchange_counts", "update_bias", "biased_top_k",
           "sequence_balance_loss", "ExpertChoice", "expert_choice_route", "Placement",
           "place_experts", "static_placement", "redundancy_table"]
