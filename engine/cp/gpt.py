"""The tiny GPT with its sequence split over a context-parallel group.

Every rank holds the whole model and ``S/N`` tokens of each sequence (:mod:`engine.cp.layout`).
Everything but attention works token by token, so it runs unchanged on the local tokens (the
position embedding looks up the positions this rank holds); attention is
:func:`engine.cp.ring_attention` (or :func:`engine.cp.ulysses_attention`, or
:func:`engine.cp.allgather_attention`), so each token still
attends to every earlier token of its sequence.

The loss is this rank's mean over its own tokens. With equal tokens per rank, the average of
those means over the ranks is the mean over the whole batch, and the gradients sum exactly as
they should (a rank's queries send gradient to other ranks' keys and values through the ring's
backward). So the context-parallel ranks average their gradients like data-parallel ones:
Megatron-Core reduces gradients over the combined data x context group; here
:class:`engine.dp.DataParallel` over the group of every replica does it.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
from torch import nn

from engine.cp.allgather import allgather_attention
from engine.cp.layout import shard_indices
from engine.cp.ring import ring_attention
from engine.cp.ulysses import ulysses_attention
from engine.topology import Mesh
from engine.validation import one_of

ATTENTIONS = ("ring", "ulysses", "allgather")


def context_parallel_core(group=None, layout: str = "zigzag", attention: str = "ring"):
    """The attention ``core(q, k, v)`` of an :class:`engine.model.gpt.Attention` that spans the
    tokens of ``group``: ring, all-gather or Ulysses attention, causal."""
    one_of("attention", attention, ATTENTIONS)
    if attention == "ring":
        return functools.partial(ring_attention, group=group, causal=True, layout=layout)
    if attention == "allgather":
        return functools.partial(allgather_attention, group=group, causal=True, layout=layout)
    return functools.partial(ulysses_attention, group=group, causal=True)


class ContextParallelGPT(nn.Module):
    """A copy ``.gpt`` of ``gpt`` (an :class:`engine.model.gpt.TinyGPT`) that takes this rank's
    tokens: each attention's ``core`` spans the group (:func:`context_parallel_core`), the
    positions are the ones this rank holds. Nothing else changes.

    ``attention="ulysses"`` needs the contiguous layout and heads divisible by the group size.
    """

    def __init__(self, gpt: nn.Module, group=None, layout: str = "zigzag",
                 attention: str = "ring"):
        super().__init__()
        one_of("attention", attention, ATTENTIONS)
        if attention == "ulysses" and layout != "contiguous":
            raise ValueError("Ulysses gathers whole sequences in rank order: use "
                             f"layout='contiguous', not {layout!r}")
        self.group, self.layout = group, layout
        self.gpt = copy.deepcopy(gpt)
        core = context_parallel_core(group, layout, attention)
        for block in self.gpt.blocks:
            block.attn.core = core

    def positions(self, local_len: int, device=None) -> torch.Tensor:
        """The positions in the whole sequence of this rank's ``local_len`` tokens."""
        n, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        return shard_indices(n * local_len, n, rank, self.layout).to(device)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits for this rank's tokens ``idx`` (``(batch, S/N)``, in the layout's order)."""
        return self.gpt(idx, self.positions(idx.shape[1], idx.device))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over this rank's tokens."""
        return self.gpt.loss(idx, targets, self.positions(idx.shape[1], idx.device))


def context_parallel_group(cp: int):
    """Split the world into groups of ``cp`` consecutive ranks (context parallelism next to
    tensor parallelism, inside data parallelism, as Megatron-Core orders them); return this
    rank's group. Every rank must call it (creating a group is collective)."""
    world = dist.get_world_size()
    if world % cp:
        raise ValueError(f"cp = {cp} must divide the world size {world}")
    return Mesh(dp=world // cp, cp=cp).cp_group  # a view of the one mesh
