"""``Plan``: the degrees and choices of one parallel layout, checked before any rank starts.

A plan names how many ranks each dimension of :class:`engine.topology.Mesh` gets (``dp``,
``cp``, ``ep``, ``tp``, ``pp``: world = dp x cp x tp x pp, ``ep`` borrowed from dp x cp), and
how each dimension runs: sequence parallelism with tensor parallelism (Korthikanti et al.
2023), ring attention in either layout, Ulysses, all-gather (Llama 3's) or 2D "USP" (Ulysses
inside groups of ``U`` ranks, ring across ``R`` groups: ``usp:UxR``; Fang & Zhao 2024) for
context parallelism, the pipeline
schedule, the ZeRO stage of the data-parallel wrapper (0: DDP; 1, 2: sharded optimizer; 3:
sharded parameters, FSDP), gradient compression. :meth:`Plan.check` raises a ValueError naming
the value and what was expected for anything the model or the batch cannot carry: a degree
that does not divide the heads, the KV heads, the experts, the layers or the sequence.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.pp.registry import SCHEDULES, build_schedule, schedule_spec
from engine.topology import Mesh, check_mesh
from engine.validation import one_of, positive_int

CP_METHODS = ("ring-zigzag", "ring-contiguous", "ulysses", "allgather", "usp:UxR")
_USP = re.compile(r"usp:(\d+)x(\d+)")


def usp_degrees(method: str) -> tuple[int, int] | None:
    """``(U, R)`` of a ``usp:UxR`` method (Ulysses over U ranks inside, ring over R groups
    across), None for any other method."""
    match = _USP.fullmatch(method)
    return (int(match.group(1)), int(match.group(2))) if match else None


def check_cp_method(method: str, cp: int | None = None) -> str:
    """``method`` if it is one of :data:`CP_METHODS` (``usp:UxR`` with U, R >= 1 and, given
    ``cp``, U x R = cp), else a ValueError naming it."""
    degrees = usp_degrees(method)
    if degrees is None:
        one_of("cp_method", method, CP_METHODS[:-1] + ("usp:UxR (e.g. usp:2x2)",))
        return method
    u, r = degrees
    if u < 1 or r < 1 or (cp is not None and u * r != cp):
        raise ValueError(f"cp_method {method!r} runs Ulysses over {u} ranks inside each of {r} "
                         f"ring groups: U x R = {u * r} must equal cp = {cp}")
    return method
ZERO_STAGES = (0, 1, 2, 3)


def check_divides(what: str, degree: int, name: str, value: int) -> None:
    """A ValueError unless ``degree`` (the ``what``) divides ``value`` (``name``)."""
    if value % degree:
        raise ValueError(f"{what} = {degree} must divide {name} = {value} "
                         f"({value} % {degree} = {value % degree})")


@dataclass(frozen=True)
class Plan:
    dp: int = 1
    cp: int = 1
    ep: int = 1
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    cp_method: str = "ring-zigzag"
    schedule: str = "1f1b"
    zero: int = 0
    compress: str | None = None
    micro_batches: int = 1

    def __post_init__(self):
        check_mesh(self.world, dp=self.dp, cp=self.cp, ep=self.ep, tp=self.tp, pp=self.pp)
        check_cp_method(self.cp_method, self.cp)
        one_of("zero", self.zero, ZERO_STAGES)
        positive_int("micro_batches", self.micro_batches)
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel=True splits the sequence over the tensor-"
                             "parallel ranks: it needs tp > 1, got tp = 1")
        if self.compress is not None and self.zero:
            raise ValueError(f"compress={self.compress!r} compresses the gradients' all-reduce: "
                             f"it needs zero = 0 (ZeRO-1 to 3 reduce-scatter), got zero = "
                             f"{self.zero}")

    def mesh(self) -> Mesh:
        """The process groups of this plan's layout: the one :class:`engine.topology.Mesh` of
        the run, derived from the plan (building it is collective: every rank calls it once, at
        the same point)."""
        return Mesh(dp=self.dp, cp=self.cp, ep=self.ep, tp=self.tp, pp=self.pp)

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def cp_layout(self) -> str:
        """The token layout over the context-parallel ranks (Ulysses: contiguous; all-gather:
        zig-zag; USP: ``"usp"``, :func:`engine.cp.usp_indices`)."""
        if usp_degrees(self.cp_method):
            return "usp"
        return "zigzag" if self.cp_method in ("ring-zigzag", "allgather") else "contiguous"

    @property
    def name(self) -> str:
        """``dp2xtp2 zero3``-style: the degrees above 1, then the choices that differ."""
        dims = [f"{d}{getattr(self, d)}" for d in ("dp", "cp", "ep", "tp", "pp")
                if getattr(self, d) > 1]
        text = "x".join(dims) or "1"
        if self.sequence_parallel:
            text += " sp"
        if self.cp > 1:
            text += f" {self.cp_method}"
        if self.pp > 1:
            text += f" {self.schedule}"
        if self.zero:
            text += f" zero{self.zero}"
        if self.compress:
            text += f" {self.compress}"
        return text

    def check(self, cfg, rows: int, varlen: bool = False) -> None:
        """Refuse, naming the value, what ``cfg`` (an :class:`engine.compose.model.ModelConfig`)
        or a global batch of ``rows`` sequences cannot carry under this plan."""
        positive_int("rows", rows)
        for name, value in (("heads", cfg.heads), ("KV heads", cfg.kv_heads_or_heads),
                            ("vocab", cfg.vocab), ("ffn_hidden", cfg.ffn)):
            check_divides("tp", self.tp, name, value)
        usp = usp_degrees(self.cp_method)
        if usp:  # R zig-zag shares of S/R tokens, each cut into U; U divides the heads
            u, r = usp
            check_divides("2 R (the ring's zig-zag chunks)", 2 * r, "seq_len",
                          cfg.seq_len)
            check_divides("U (Ulysses inside usp)", u, "the tokens of one ring share",
                          cfg.seq_len // r)
            check_divides("U (Ulysses gives each rank whole heads)", u,
                          "heads" + (" per tensor-parallel rank" if self.tp > 1 else ""),
                          cfg.heads // self.tp)
        pieces = self.cp * (2 if self.cp_layout == "zigzag" else 1)
        if not usp and cfg.seq_len % pieces:
            raise ValueError(f"cp = {self.cp} with {self.cp_method} cuts the sequence into "
                             f"{pieces} equal chunks: {pieces} must divide seq_len = "
                             f"{cfg.seq_len}")
        if self.cp_method == "ulysses":
            per = " per tensor-parallel rank" if self.tp > 1 else ""
            for name, value in (("heads", cfg.heads), ("KV heads", cfg.kv_heads_or_heads)):
                check_divides("cp (Ulysses gives each rank whole heads)", self.cp,
                              name + per, value // self.tp)
        if self.sequence_parallel:
            check_divides("tp (sequence parallelism)", self.tp,
                          "the tokens per context-parallel rank", cfg.seq_len // self.cp)
        if cfg.num_experts:
            check_divides("ep", self.ep, "num_experts", cfg.num_experts)
        elif self.ep > 1:
            raise ValueError(f"ep = {self.ep} spreads experts, but the model is dense "
                             "(num_experts = 0)")
        if self.pp > 1 and self.micro_batches < self.pp:
            raise ValueError(f"schedule {self.schedule!r} on pp = {self.pp} stages needs at "
                             f"least {self.pp} micro-batches to keep every stage busy, got "
                             f"micro_batches = {self.micro_batches}")
        if self.pp > 1:
            one_of("schedule", self.schedule, tuple(SCHEDULES))
            try:  # the schedule's own demands (DualPipeV: m >= 2p; interleaved: p divides m)
                build_schedule(self.schedule, self.pp, self.micro_batches)
            except ValueError as e:
                raise ValueError(f"schedule {self.schedule!r} on pp = {self.pp} with "
                                 f"micro_batches = {self.micro_batches}: {e}") from None
            chunks = self.pp * schedule_spec(self.schedule).chunks  # interleaved: 2 a rank
            if self.pp > cfg.layers:
                raise ValueError(f"pp = {self.pp} pipeline stages need at least {self.pp} "
                                 f"layers, the model has {cfg.layers}")
            if chunks > cfg.layers:
                raise ValueError(f"pp = {self.pp} with schedule {self.schedule!r} cuts the model "
                                 f"into {chunks} chunks of at least one layer each, the model "
                                 f"has {cfg.layers} layers")
            if cfg.layers % chunks:  # equal chunks: no stage waits on a longer one
                raise ValueError(f"pp = {self.pp} with schedule {self.schedule!r} cuts the model "
                                 f"into pp x chunks per rank = {chunks} equal chunks: {chunks} "
                                 f"must divide layers = {cfg.layers}")
        check_divides("dp x micro_batches", self.dp * self.micro_batches, "rows", rows)
