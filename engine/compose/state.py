"""The whole parameters of a parallelised GPT, from any layout, named as the dense GPT's: what
the parity matrix compares with one process.

ZeRO-3 first: each parameter's dim-0 shards are all-gathered over the data-parallel group
(:func:`engine.fsdp.gather_full`). Then tensor parallelism: each split parameter
is all-gathered over ``mesh.tp_group`` and joined on the dimension the one table,
:data:`engine.tp.layout.TP_SPLIT`, names (the fused ``[q | k | v]`` by heads: rank r holds its
query, key and value heads side by side). Call on every rank (collective).
"""

from __future__ import annotations

import re

import torch

from engine.compose.parallelize import Parallel
from engine.fsdp import gather_full
from engine.tp.mappings import gather_dim
from engine.tp.layout import HALVES, HEADS, halves, heads_joined, qkv_sizes, split_dim

_EXPERT = re.compile(r"blocks\.(\d+)\.moe\.experts\.(\d+)\.(.*)")


def local_tensors(par: Parallel) -> dict[int, torch.Tensor]:
    """``id(parameter) -> this rank's tensor of it`` (ZeRO-3: each shard gathered whole over
    the data-parallel group, :func:`engine.fsdp.gather_full`; its ``ignored_params``, the
    experts, as they are)."""
    group = par.mesh.dp_cp_group
    return {id(p): gather_full(p, group) if hasattr(p, "fsdp_layout") else p.detach()
            for p in par.model.parameters()}


def join_tp(name: str, local: torch.Tensor, par: Parallel) -> torch.Tensor:
    """The dense parameter ``name`` from this rank's ``local`` slice: all-gathered over the
    tensor-parallel group and joined as :data:`engine.tp.layout.TP_SPLIT` says."""
    split = split_dim(name)
    if par.tp_group is None or split is None:
        return local.clone()
    if split not in (HEADS, HALVES):
        return gather_dim(local, split, par.tp_group)
    cfg = par.model.cfg
    slices = list(gather_dim(local, 0, par.tp_group).chunk(par.mesh.tp, dim=0))
    if split == HALVES:
        return heads_joined(slices, halves(2 * cfg.ffn))
    return heads_joined(slices, qkv_sizes(cfg.heads, cfg.kv_heads_or_heads, cfg.head_dim))


def global_expert_name(name: str, par: Parallel) -> str:
    """``blocks.0.moe.experts.1.fc.weight`` on a rank holding experts 2 and 3 ->
    ``blocks.0.moe.experts.3.fc.weight``: the name one process gives it."""
    match = _EXPERT.fullmatch(name)
    if match is None:
        return name
    block, local, rest = match.groups()
    first = par.model.blocks[int(block)].moe.first_expert
    return f"blocks.{block}.moe.experts.{first + int(local)}.{rest}"


def dense_state(par: Parallel) -> dict[str, torch.Tensor]:
    """Every parameter this rank holds, whole over tensor parallelism, named as
    :class:`engine.compose.model.GPT` names it in one process (under expert parallelism a rank
    holds only its experts: the union over the ep group is the model)."""
    tensors = local_tensors(par)
    return {global_expert_name(name, par): join_tp(name, tensors[id(p)], par)
            for name, p in par.model.named_parameters(remove_duplicate=False)}
