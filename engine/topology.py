"""``Mesh(dp=, tp=, pp=)``: every rank's place in a 3D layout, and every process group, built
once.

Ranks are numbered with tensor parallelism fastest, then data parallelism, then pipeline
stages (Megatron-LM's default order; Narayanan et al., SC 2021, section 3.3):

    rank = pp_index * (dp * tp) + dp_index * tp + tp_index

so the ``tp`` ranks of a tensor-parallel group are consecutive: on nodes of 8 GPUs with
``tp <= 8`` they share a node and its NVLink, which their per-layer all-reduces need. Data-
and pipeline-parallel traffic, lighter per byte of compute, crosses nodes.

Every rank must build the same ``Mesh`` (``torch.distributed.new_group`` is collective: all
ranks create every group, in the same order). With pipeline stages, the first and the last
stage of each (dp, tp) position also share an *embedding group*: a GPT's input embedding and
its tied output layer live on those two stages, and their gradients are summed there
(Megatron-LM does the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from engine.validation import positive_int


@dataclass(frozen=True)
class Coordinates:
    dp: int
    tp: int
    pp: int


def new_groups(groups: list[list[int]], rank: int):
    """Create every group of ``groups`` (every rank must call this, with the same lists in the
    same order, as ``dist.new_group`` requires); return the one holding ``rank``."""
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


class Mesh:
    """The (dp, tp, pp) layout of the world, with ``.dp_group``, ``.tp_group``, ``.pp_group``
    and ``.embedding_group`` for this rank."""

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1):
        for name, value in (("dp", dp), ("tp", tp), ("pp", pp)):
            positive_int(name, value)
        world = dist.get_world_size()
        if dp * tp * pp != world:
            raise ValueError(f"dp x tp x pp = {dp} x {tp} x {pp} = {dp * tp * pp} does not "
                             f"match the world size {world}")
        self.dp, self.tp, self.pp = dp, tp, pp
        self.rank = dist.get_rank()
        self.coords = self.coordinates(self.rank)
        self.tp_group = self._build(self._tp_groups())
        self.dp_group = self._build(self._dp_groups())
        self.pp_group = self._build(self._pp_groups())
        self.embedding_group = self._build(
            [sorted({g[0], g[-1]}) for g in self._pp_groups()]) if pp > 1 else None

    # -- layout ----------------------------------------------------------------------------------

    def rank_of(self, dp: int, tp: int, pp: int) -> int:
        return pp * self.dp * self.tp + dp * self.tp + tp

    def coordinates(self, rank: int) -> Coordinates:
        pp, rest = divmod(rank, self.dp * self.tp)
        dp, tp = divmod(rest, self.tp)
        return Coordinates(dp=dp, tp=tp, pp=pp)

    def _tp_groups(self):
        return [[self.rank_of(d, t, p) for t in range(self.tp)]
                for p in range(self.pp) for d in range(self.dp)]

    def _dp_groups(self):
        return [[self.rank_of(d, t, p) for d in range(self.dp)]
                for p in range(self.pp) for t in range(self.tp)]

    def _pp_groups(self):
        return [[self.rank_of(d, t, p) for p in range(self.pp)]
                for d in range(self.dp) for t in range(self.tp)]

    def _build(self, groups):
        return new_groups(groups, self.rank)

    # -- neighbours ------------------------------------------------------------------------------

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.pp - 1

    @property
    def prev_stage_rank(self) -> int | None:
        c = self.coords
        return None if self.is_first_stage else self.rank_of(c.dp, c.tp, c.pp - 1)

    @property
    def next_stage_rank(self) -> int | None:
        c = self.coords
        return None if self.is_last_stage else self.rank_of(c.dp, c.tp, c.pp + 1)

    def describe(self) -> str:
        c = self.coords
        return (f"rank {self.rank}: dp {c.dp}/{self.dp}, tp {c.tp}/{self.tp}, "
                f"pp {c.pp}/{self.pp}")

    def __repr__(self) -> str:
        return f"Mesh(dp={self.dp}, tp={self.tp}, pp={self.pp})"
