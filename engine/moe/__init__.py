"""Mixture of experts and expert parallelism (chapter 10).

:mod:`~engine.moe.router` picks each token's experts and enforces their capacity;
:mod:`~engine.moe.dispatch` sends tokens to the ranks holding their experts and back with two
all-to-alls; :class:`MoE` is the layer; :mod:`~engine.moe.gpt` the tiny GPT built on it;
:mod:`~engine.moe.mesh` the expert x data-parallel layout and which group reduces which
gradient; :mod:`~engine.moe.experiments` the load and drop measurements.
"""

from engine.moe.dispatch import DispatchState, all_to_all, combine, dispatch, exchange_counts
from engine.moe.gpt import TinyMoEGPT, expert_parallel, expert_parameters
from engine.moe.layer import Expert, MoE, MoEStats, single_rank_group
from engine.moe.mesh import ExpertMesh, check_layout, reduce_gradients
from engine.moe.router import Routing, load_balancing_loss, route, router_z_loss

__all__ = ["MoE", "Expert", "MoEStats", "single_rank_group", "Routing", "route",
           "load_balancing_loss", "router_z_loss", "dispatch", "combine", "DispatchState",
           "all_to_all", "exchange_counts", "TinyMoEGPT", "expert_parallel",
           "expert_parameters", "ExpertMesh", "check_layout", "reduce_gradients"]
