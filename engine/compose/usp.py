"""2D context parallelism ("USP", Fang & Zhao 2024) on the composed mesh: Ulysses inside groups
of ``U`` context-parallel ranks, ring attention across ``R`` such groups (``--cp-method
usp:UxR``, ``cp = U x R``).

Every context-parallel group of :class:`engine.topology.Mesh` (ranks ``c = 0 .. cp-1`` at
fixed dp, tp and pp coordinates) is cut by :meth:`engine.topology.Mesh.split` (``cp`` into
``cp_ring x cp_ulysses``, as :func:`engine.cp.usp_groups` does): its Ulysses groups are ``U``
consecutive cp indices ``c = g U .. (g+1) U - 1`` (ring index ``g``), its rings the cp indices
with the same place ``j`` in their Ulysses group; the mesh builds them once and caches them.
A rank of cp index ``c`` holds the tokens :func:`engine.cp.usp_indices` names: ring share
``c // U`` (zig-zag over the ``R`` rings), its ``c % U``-th consecutive piece.

The attention runs :func:`engine.cp.usp_attention` with ``check=False``: its check is a
collective over the whole world, which the ranks of other pipeline stages do not join at the
same moment; the plan checks the shapes before any rank starts
(:meth:`engine.compose.plan.Plan.check`).
"""

from __future__ import annotations

import functools

import torch

from engine.cp import usp_attention, usp_groups, usp_indices
from engine.topology import Mesh


def mesh_usp_groups(mesh: Mesh, ulysses: int):
    """``(ulysses_group, ring_group)`` of this rank inside its context-parallel group.
    Collective on the first call for a mesh: every rank calls it."""
    return usp_groups(ulysses, mesh)


def usp_core(mesh: Mesh, ulysses: int):
    """The attention ``core(q, k, v)`` of every block under ``usp:UxR``."""
    uly, ring = mesh_usp_groups(mesh, ulysses)
    return functools.partial(usp_attention, ulysses_group=uly, ring_group=ring, causal=True,
                             layout="zigzag", check=False)


def usp_tokens(seq_len: int, cp: int, ulysses: int, cp_index: int) -> torch.Tensor:
    """Positions of the tokens the rank of context-parallel index ``cp_index`` holds."""
    return usp_indices(seq_len, cp // ulysses, ulysses, cp_index)
