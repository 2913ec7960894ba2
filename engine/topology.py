"""``Mesh(dp=, cp=, ep=, tp=, pp=)``: every rank's place in the layout of named parallel
dimensions, and every process group, built once.

Ranks are numbered with tensor parallelism fastest, then context parallelism, then data
parallelism, then pipeline stages (Megatron-Core's order tp-cp-ep-dp-pp; Narayanan et al.,
SC 2021, section 3.3, for dp x tp x pp):

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

so the ``tp`` ranks of a tensor-parallel group are consecutive: on nodes of 8 GPUs with
``tp <= 8`` they share a node and its NVLink, which their per-layer all-reduces need; a
context-parallel group (ring or all-to-all attention traffic every layer) comes next. Data-
and pipeline-parallel traffic, lighter per byte of compute, crosses nodes. With ``cp = 1`` the
numbering is the 3D one, ``pp_index * (dp * tp) + dp_index * tp + tp_index``, unchanged.
``init_device_mesh(device, (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))`` gives
the same rank sets (tests/test_mesh.py).

**The world is dp x cp x tp x pp.** Expert parallelism adds no ranks: it *borrows* them from
the dp x cp ranks of one (tp, pp) position (torchtitan, Megatron-Core), so ``ep`` must divide
``dp * cp``. Number those ranks ``i = dp_index * cp + cp_index``; the expert-parallel group is
``ep`` consecutive ones (``i // ep`` equal), the *expert data-parallel* group the ranks that
hold the same experts (``i % ep`` equal).

**Which group reduces which gradient.** A dense parameter is replicated over every dp x cp
rank of its (tp, pp) position, each of which saw different tokens: its gradient is reduced
over ``dp_cp_group``. An expert's parameters are replicated only over ``expert_dp_group``
(the other ranks of the ep group hold other experts): its gradient is reduced there.

Every rank must build the same ``Mesh`` (``torch.distributed.new_group`` is collective: all
ranks create every group, in the same order; a set of ranks already built is reused). With
pipeline stages, the first and the last stage of each (dp, cp, tp) position also share an
*embedding group*: a GPT's input embedding and its tied output layer live on those two
stages, and their gradients are summed there (Megatron-LM does the same).

**Sub-axes.** :meth:`Mesh.split` unflattens one dimension into ``outer x inner``, inner
fastest, as PyTorch's ``DeviceMesh`` unflattens a dimension: torchtitan's HSDP cuts ``dp`` into
``dp_replicate x dp_shard`` (:class:`engine.zero.hsdp.HybridShardedDataParallel`), USP cuts
``cp`` into ``cp_ring x cp_ulysses`` (:func:`engine.cp.usp_groups`; Fang & Zhao 2024), so a
shard group (or a Ulysses group) is ``inner`` consecutive indices of the dimension and a
replica group (or a ring) the indices with the same place in theirs. ``init_device_mesh`` with
``("pp", "dp_replicate", "dp_shard", "cp", "tp")`` or ``("pp", "dp", "cp_ring", "cp_ulysses",
"tp")`` gives the same rank sets (tests/test_mesh.py). The groups of a split are built on its
first call and cached on the mesh: that first call is collective, so every rank makes the same
splits in the same order. No other module creates a group of the layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from engine.validation import divides, positive_int

DIMENSIONS = ("pp", "dp", "cp", "tp")  # slowest to fastest: init_device_mesh's order
SUB_AXES = {"dp": ("dp_replicate", "dp_shard"), "cp": ("cp_ring", "cp_ulysses")}  # outer, inner


@dataclass(frozen=True)
class Coordinates:
    """A rank's index along each dimension (``ep``: its slot in its expert-parallel group)."""

    dp: int
    tp: int
    pp: int
    cp: int = field(default=0, repr=False)
    ep: int = field(default=0, repr=False)


def split_rank_sets(sets: list[list[int]], inner: int) -> tuple[list[list[int]],
                                                                 list[list[int]]]:
    """Each group of ``sets`` (its ranks in index order) unflattened into ``outer x inner``,
    inner fastest: ``(inner groups, outer groups)``, the inner ones ``inner`` consecutive
    members, the outer ones the members with the same place in their inner group. Pure."""
    positive_int("inner", inner)
    for ranks in sets:
        divides("inner", inner, "the size of the dimension it splits", len(ranks))
    inner_sets = [ranks[g:g + inner] for ranks in sets for g in range(0, len(ranks), inner)]
    outer_sets = [ranks[j::inner] for ranks in sets for j in range(inner)]
    return inner_sets, outer_sets


def check_mesh(world: int, dp: int = 1, cp: int = 1, ep: int = 1, tp: int = 1,
               pp: int = 1) -> None:
    """A ValueError naming the bad degree, before any rank starts: each a positive int,
    ``dp x cp x tp x pp`` the world size, ``ep`` a divisor of ``dp x cp``."""
    for name, value in (("dp", dp), ("cp", cp), ("ep", ep), ("tp", tp), ("pp", pp)):
        positive_int(name, value)
    if dp * cp * tp * pp != world:
        if cp == 1:
            raise ValueError(f"dp x tp x pp = {dp} x {tp} x {pp} = {dp * tp * pp} does not "
                             f"match the world size {world}")
        raise ValueError(f"dp x cp x tp x pp = {dp} x {cp} x {tp} x {pp} = "
                         f"{dp * cp * tp * pp} does not match the world size {world}")
    if (dp * cp) % ep:
        raise ValueError(f"ep = {ep} must divide dp x cp = {dp} x {cp} = {dp * cp}: expert "
                         "parallelism borrows its ranks from the data- and context-parallel "
                         "ranks")


class Mesh:
    """The (dp, cp, ep, tp, pp) layout of the world, with this rank's ``.dp_group``,
    ``.cp_group``, ``.ep_group``, ``.tp_group``, ``.pp_group``, ``.embedding_group``, and
    the gradient groups ``.dp_cp_group`` (dense parameters) and ``.expert_dp_group``
    (expert parameters)."""

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, *, cp: int = 1, ep: int = 1):
        world = dist.get_world_size()
        check_mesh(world, dp=dp, cp=cp, ep=ep, tp=tp, pp=pp)
        self.dp, self.tp, self.pp, self.cp, self.ep = dp, tp, pp, cp, ep
        self.rank = dist.get_rank()
        self.coords = self.coordinates(self.rank)
        self._built: dict[tuple[int, ...], object] = {}
        self._splits: dict[tuple[str, int], tuple] = {}
        # the 3D groups first, each created anew in its historical order (as before cp and
        # ep existed); then what cp and ep add, reusing a group whose ranks exist already
        self.tp_group = self._build(self.rank_sets("tp"), reuse=False)
        self.dp_group = self._build(self.rank_sets("dp"), reuse=False)
        self.pp_group = self._build(self.rank_sets("pp"), reuse=False)
        self.embedding_group = self._build(
            [sorted({g[0], g[-1]}) for g in self.rank_sets("pp")], reuse=False) \
            if pp > 1 else None
        self.cp_group = self._build(self.rank_sets("cp"))
        self.dp_cp_group = self._build(self.rank_sets("dp_cp"))
        self.ep_group = self._build(self.rank_sets("ep"))
        self.expert_dp_group = self._build(self.rank_sets("expert_dp"))

    # -- layout ----------------------------------------------------------------------------------

    def rank_of(self, dp: int, tp: int, pp: int, cp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coordinates(self, rank: int) -> Coordinates:
        rest, tp = divmod(rank, self.tp)
        rest, cp = divmod(rest, self.cp)
        pp, dp = divmod(rest, self.dp)
        return Coordinates(dp=dp, tp=tp, pp=pp, cp=cp, ep=(dp * self.cp + cp) % self.ep)

    @property
    def dp_cp_size(self) -> int:
        """Replicas of a dense parameter: the ranks its gradient is reduced over."""
        return self.dp * self.cp

    def rank_sets(self, name: str) -> list[list[int]]:
        """Every group of kind ``name`` (``dp``, ``cp``, ``tp``, ``pp``, ``dp_cp``, ``ep``,
        ``expert_dp``) as lists of global ranks, in the order they are created. Pure."""
        positions = [(p, d, c, t) for p in range(self.pp) for d in range(self.dp)
                     for c in range(self.cp) for t in range(self.tp)]
        if name in ("ep", "expert_dp"):
            sets = []
            for position in self.rank_sets("dp_cp"):  # one per (pp, tp)
                blocks = [position[i:i + self.ep] for i in range(0, len(position), self.ep)]
                sets += blocks if name == "ep" else [list(g) for g in zip(*blocks)]
            return sets
        varying = {"dp": (1,), "cp": (2,), "tp": (3,), "pp": (0,), "dp_cp": (1, 2)}[name]
        groups: dict[tuple, list[int]] = {}
        for p, d, c, t in positions:
            key = tuple(v for i, v in enumerate((p, d, c, t)) if i not in varying)
            groups.setdefault(key, []).append(self.rank_of(d, t, p, c))
        return list(groups.values())

    def split(self, dim: str, inner: int):
        """``(inner_group, outer_group)`` of this rank: dimension ``dim`` unflattened into
        ``outer x inner`` (:func:`split_rank_sets`; ``dp`` into ``dp_replicate x dp_shard``,
        ``cp`` into ``cp_ring x cp_ulysses``). Built on the first call for ``(dim, inner)``,
        then cached: that first call is collective (every rank makes it, in the same order)."""
        key = (dim, inner)
        if key not in self._splits:
            inner_sets, outer_sets = self.split_rank_sets(dim, inner)
            self._splits[key] = (self._build(inner_sets), self._build(outer_sets))
        return self._splits[key]

    def split_rank_sets(self, dim: str, inner: int) -> tuple[list[list[int]], list[list[int]]]:
        """``(inner groups, outer groups)`` of :meth:`split` as lists of global ranks. Pure."""
        if dim not in DIMENSIONS:
            raise ValueError(f"a split cuts one of the dimensions {DIMENSIONS}, got {dim!r}")
        positive_int(f"inner ({dim} split)", inner)
        divides(f"inner ({dim} split)", inner, dim, getattr(self, dim))
        return split_rank_sets(self.rank_sets(dim), inner)

    def _build(self, groups: list[list[int]], reuse: bool = True):
        mine = None
        for ranks in groups:
            key = tuple(ranks)
            group = self._built.get(key) if reuse else None
            if group is None:
                group = dist.new_group(ranks)
                self._built.setdefault(key, group)
            if self.rank in ranks:
                mine = group
        return mine

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
        return None if self.is_first_stage else self.rank_of(c.dp, c.tp, c.pp - 1, c.cp)

    @property
    def next_stage_rank(self) -> int | None:
        c = self.coords
        return None if self.is_last_stage else self.rank_of(c.dp, c.tp, c.pp + 1, c.cp)

    def describe(self) -> str:
        c = self.coords
        text = f"rank {self.rank}: dp {c.dp}/{self.dp}, tp {c.tp}/{self.tp}, pp {c.pp}/{self.pp}"
        if self.cp > 1:
            text += f", cp {c.cp}/{self.cp}"
        if self.ep > 1:
            text += f", ep {c.ep}/{self.ep}"
        return text

    def __repr__(self) -> str:
        more = "".join(f", {k}={v}" for k, v in (("cp", self.cp), ("ep", self.ep)) if v > 1)
        return f"Mesh(dp={self.dp}, tp={self.tp}, pp={self.pp}{more})"
