"""Pipeline parallelism (chapter 06): the bubble, the zero-bubble schedules (the backward
split into B, the input gradient, and W, the weight gradient), peak activations and hops.

Part of :mod:`engine.theory`: pure formulas, each naming its source; sizes in bytes.
"""

from __future__ import annotations

from engine.theory.collectives import check_n
from engine.theory.schedule_facts import SCHEDULE_FACTS
from engine.validation import one_of, positive_int


def bubble_fraction(p: int, m: int, v: int = 1, relative_to: str = "total") -> float:
    """Pipeline bubble with ``p`` stages, ``m`` micro-batches and ``v`` chunks per stage,
    uniform stages, no communication time. Two definitions, both in use:

    * ``relative_to="total"``: idle share of the whole run, ``(p-1) / (v*m + p - 1)``
      (GPipe, Huang et al. 2019, section 2.3, with v = 1);
    * ``relative_to="ideal"``: idle time over the ideal (busy) time, ``(p-1) / (v*m)``
      (Megatron-LM, Narayanan et al. 2021, section 2.2).

    1F1B has the same bubble as GPipe; interleaving divides it by ``v``."""
    check_n(p)
    positive_int("m", m)
    positive_int("v", v)
    if relative_to == "total":
        return (p - 1) / (v * m + p - 1)
    if relative_to == "ideal":
        return (p - 1) / (v * m)
    raise ValueError(f"relative_to must be 'total' or 'ideal', got {relative_to!r}")


def _stage_times(t_f: float, t_b: float, t_w: float) -> None:
    from engine.validation import non_negative_number, positive_number

    positive_number("t_f", t_f)
    positive_number("t_b", t_b)
    non_negative_number("t_w", t_w)


def one_f_one_b_bubble_time(p: int, t_f: float, t_b: float, t_w: float = 0.0) -> float:
    """Idle time of each stage under GPipe or 1F1B: ``(p-1)(T_F + T_B + T_W)``, the warm-up
    and cool-down of ``p-1`` forward and *full* backward slots (the full backward is the input
    gradient ``T_B`` plus the weight gradient ``T_W``; Qi et al., "Zero Bubble Pipeline
    Parallelism", ICLR 2024, section 2.1). With ``t_w = 0``, ``t_b`` is the whole backward."""
    check_n(p)
    _stage_times(t_f, t_b, t_w)
    return (p - 1) * (t_f + t_b + t_w)


def zb_h1_bubble_time(p: int, t_f: float, t_b: float, t_w: float, b: str = "input") -> float:
    """Idle time of each stage under ZB-H1 (Qi et al., ICLR 2024, section 2.1, Figure 3):
    ``(p-1)(T_F + T_B - T_W)`` where ``T_B`` is the *input* gradient alone (``b="input"``, the
    paper's B). The DualPipe README (deepseek-ai/DualPipe, its row "ZB1P") writes
    ``(PP-1)(F + B - 2W)`` where B is the *full* backward, input and weights (``b="full"``):
    the same number, since ``B_full = T_B + T_W``. Exact when ``m >= p`` and
    ``T_W <= T_F, T_B`` (the simulator's ZB-H1 matches it there); other times are refused."""
    from engine.validation import one_of

    one_of("b", b, ("input", "full"))
    t_input = t_b - t_w if b == "full" else t_b
    check_n(p)
    _stage_times(t_f, t_input, t_w)
    if t_w > min(t_f, t_input):
        raise ValueError(f"the ZB-H1 formula holds for T_W <= T_F and T_W <= T_B (input "
                         f"gradient); got T_F={t_f}, T_B={t_input}, T_W={t_w}")
    return (p - 1) * (t_f + t_input - t_w)


def zb_h1_bubble_fraction(p: int, m: int, t_f: float, t_b: float, t_w: float) -> float:
    """ZB-H1's idle share of the total time: ``(p-1)(T_F+T_B-T_W)`` over
    ``m(T_F+T_B+T_W) + (p-1)(T_F+T_B-T_W)``, with ``T_B`` the input gradient alone."""
    from engine.validation import positive_int

    positive_int("m", m)
    idle = zb_h1_bubble_time(p, t_f, t_b, t_w)
    return idle / (m * (t_f + t_b + t_w) + idle)


def zb_h2_bubble_time(p: int, t_f: float, t_b: float, t_w: float) -> float:
    """Idle time of each stage under ZB-H2 (Qi et al., ICLR 2024, section 2.2, "Zero bubble
    schedule", and the paper's table of bubble and peak memory per schedule): ``(p-1)(T_F + T_B - 2T_W)``,
    ``T_B`` the input gradient alone; zero when ``T_F = T_B = T_W``. Derivation: stage ``s``
    receives its first B after ``2(p-1-s)+1`` slots and fills them with forwards; in the tail
    the last B's reach stage 0 one B per stage late, and stage ``s`` fills the ``2s`` slots by
    running its W's ``2s`` backwards late. What is left per stage, measured within the stage's
    own span (its first forward to its last W) or per step when steps follow each other with
    no synchronised optimizer step (section 4, post-validation): ``p-1`` times the mismatch
    ``T_F + T_B - 2T_W``. Exact (the simulator's :func:`engine.pp.zero_bubble.zb_h2` matches
    it) when ``m >= 2p-1`` and ``T_W <= T_F, T_B``; other times are refused."""
    check_n(p)
    _stage_times(t_f, t_b, t_w)
    if t_w > min(t_f, t_b):
        raise ValueError(f"the ZB-H2 formula holds for T_W <= T_F and T_W <= T_B (input "
                         f"gradient); got T_F={t_f}, T_B={t_b}, T_W={t_w}")
    return (p - 1) * (t_f + t_b - 2 * t_w)


def pipeline_peak_activations(schedule: str, p: int) -> float:
    """Peak activations of the busiest rank (stage 0) under ``schedule`` (a schedule whose
    record in :data:`engine.theory.schedule_facts.SCHEDULE_FACTS` has a ``peak``, with its
    source), in units of ``M_B`` (one micro-batch's activations for the rank's whole share of
    the model, both chunks of a V together): ``p`` for 1F1B, ZB-H1 and ZB-V, ``2p-1`` for
    ZB-H2, ``p + 1/2`` for DualPipeV. Counted as micro-batches between F and B; a split
    backward's W-stash (each linear layer's input and output gradient, held from B to W)
    comes on top."""
    one_of("schedule", schedule, tuple(n for n, f in SCHEDULE_FACTS.items() if f.peak))
    check_n(p)
    return SCHEDULE_FACTS[schedule].peak.of_p(p)


def pipeline_p2p_hops(schedule: str, p: int, v: int = 2) -> int:
    """Point-to-point messages between ranks per micro-batch per step: one activation forward
    and one gradient backward at every boundary between two virtual stages on different
    ranks. One chunk per rank (1F1B, ZB-H1, ZB-H2): ``2(p-1)``. A V (ZB-V, DualPipeV): ``2p``
    virtual stages, whose middle boundary stays on rank ``p-1``: ``2(2p-2) = 4(p-1)``, twice
    as many. Interleaved with ``v`` chunks: ``2(vp-1)``. The chunks and their placement are
    the schedule's record in :data:`engine.theory.schedule_facts.SCHEDULE_FACTS` (``v`` counts
    where the caller picks the chunks)."""
    one_of("schedule", schedule, tuple(SCHEDULE_FACTS))
    check_n(p)
    facts = SCHEDULE_FACTS[schedule]
    if facts.takes_chunks:
        positive_int("v", v)
    chunks = v if facts.takes_chunks else facts.chunks
    boundaries = chunks * p - 1 - (1 if facts.placement == "v" else 0)  # a V's middle is local
    return 2 * boundaries
