"""2D attention: Ulysses inside a group, ring attention across groups ("USP").

Fang & Zhao, "USP: a unified sequence parallelism approach for long context generative AI"
(2024). ``N = u x r`` ranks: ``r`` ring groups hold ``S/r`` tokens each (zig-zag across them
for the causal balance), and inside one, ``u`` Ulysses ranks (consecutive, one node: the
all-to-alls stay on NVLink) hold ``S/N`` consecutive tokens of that share. Attention is:

1. the Ulysses all-to-all inside the group (:func:`engine.cp.ulysses.scatter_heads`): each rank
   now has its group's ``S/r`` tokens of ``heads/u`` heads (KV heads replicated past ``u``);
2. ring attention across the ``r`` groups on those heads (:func:`engine.cp.ring_attention`,
   ``u`` independent rings, one per head slice);
3. the second all-to-all back to ``S/N`` tokens of every head.

Each part lifts the other's limit: Ulysses alone stops at the query heads and crosses the
whole group in its all-to-all; the ring alone sends ``2 S kv_hidden`` per rank whatever N.
Bytes: :func:`engine.theory.usp_bytes`; memory: :func:`engine.theory.cp_memory_bytes`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.cp.buffers import hold
from engine.cp.checks import check_attention_inputs, check_same_on_every_rank
from engine.cp.layout import check_sequence_split, shard_indices
from engine.cp.ring import ring_attention
from engine.cp.ulysses import check_ulysses_heads, gather_heads, scatter_heads
from engine.topology import Mesh
from engine.validation import divides


def usp_groups(ulysses: int, mesh: Mesh | None = None):
    """``(ulysses_group, ring_group)`` of this rank: the ``cp`` dimension of ``mesh``
    (``Mesh(cp=world)`` by default) split into ``cp_ring x cp_ulysses``
    (:meth:`engine.topology.Mesh.split`): Ulysses groups of ``ulysses`` consecutive
    context-parallel ranks, rings of the ranks with the same place in their Ulysses group.
    Collective: every rank must call it."""
    if mesh is None:
        world = dist.get_world_size()
        divides("ulysses", ulysses, "the world size", world)
        mesh = Mesh(cp=world)
    return mesh.split("cp", inner=ulysses)


def usp_indices(seq_len: int, ring: int, ulysses: int, rank: int, layout: str = "zigzag"
                ) -> torch.Tensor:
    """Positions of the tokens rank ``rank`` (``= ring index x ulysses + Ulysses index``)
    holds: its ring group's ``layout`` share of ``S/ring`` tokens, cut into ``ulysses``
    consecutive pieces."""
    check_sequence_split(seq_len, ring, layout)
    divides("ulysses x ring", ulysses * ring, "the sequence length", seq_len)
    share = shard_indices(seq_len, ring, rank // ulysses, layout)
    return share.chunk(ulysses)[rank % ulysses]


def usp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ulysses_group, ring_group,
                  causal: bool = True, layout: str = "zigzag", check: bool = True
                  ) -> torch.Tensor:
    """``scaled_dot_product_attention`` over the whole sequence for this rank's tokens
    (:func:`usp_indices`), computed as Ulysses inside ``ulysses_group`` and ring attention
    across ``ring_group`` (:func:`usp_groups`). ``q``: ``(batch, heads, S/N, head_dim)``,
    ``k``, ``v``: ``(batch, kv_heads, S/N, head_dim)``; ``u`` must divide ``heads``."""
    check_attention_inputs(q, k, v, "usp_attention")
    u = dist.get_world_size(ulysses_group)
    check_ulysses_heads(q.shape[1], k.shape[1], u)
    if check:
        check_same_on_every_rank(q, k, None, "usp_attention")
    q, k, v = scatter_heads(q, k, v, ulysses_group, "usp_attention")
    hold("forward", q, k, v)  # the group's S/r tokens of heads/u heads; the ring's come next
    out = ring_attention(q.contiguous(), k.contiguous(), v.contiguous(), ring_group, causal,
                         layout, check=check)
    return gather_heads(out, ulysses_group)
