"""What is known of each pipeline schedule the engine runs, in one table: where its model
chunks live, how many each rank holds, its name in print and in
``torch.distributed.pipelining``, and the peak activations of its busiest rank with the
source of that count.

The table sits in the foundations layer so that the formulas of :mod:`engine.theory.pipeline`
and the registry of :mod:`engine.pp.registry` (which pairs each entry with the generator that
writes the order) read the same facts: theory cannot import the pipeline package above it.

* GPipe (Huang et al., NeurIPS 2019) and 1F1B (PipeDream-Flush, Narayanan et al., ICML 2021):
  one chunk per rank;
* interleaved 1F1B (Megatron-LM, Narayanan et al., SC 2021, section 2.2): ``v`` chunks per
  rank, the caller's choice, 2 unless it says otherwise;
* ZB-H1, ZB-H2 and ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, sections
  2.1, 2.2 and 6), DualPipeV (deepseek-ai/DualPipe): the backward split into B and W; ZB-V
  and DualPipeV hold two chunks per rank placed in a V.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional


class Peak(NamedTuple):
    """Peak activations of the busiest rank, in ``M_B``: one micro-batch's activations for
    the rank's whole share of the model (both chunks of a V schedule together). ``formula``
    as printed, ``of_p(p)`` its value for ``p`` ranks, and its ``source``."""

    formula: str
    of_p: Callable[[int], float]
    source: str


class ScheduleFacts(NamedTuple):
    """``placement``: ``"interleaved"`` (chunk ``c`` of rank ``s`` is virtual stage
    ``c * p + s``) or ``"v"`` (rank 0 holds stages 0 and ``2p - 1``); ``chunks``: model
    chunks per rank (where ``takes_chunks``, the caller may pick another number, and this is
    the default); ``label``: the name printed; ``torch_class``: the class of
    ``torch.distributed.pipelining.schedules`` with the same order, if any; ``peak``:
    :class:`Peak`, where a published count is known."""

    placement: str
    chunks: int
    label: str
    torch_class: Optional[str] = None
    takes_chunks: bool = False
    peak: Optional[Peak] = None


SCHEDULE_FACTS: dict[str, ScheduleFacts] = {
    "gpipe": ScheduleFacts("interleaved", 1, "GPipe"),
    "1f1b": ScheduleFacts("interleaved", 1, "1F1B", peak=Peak(
        "p", lambda p: p,
        "Narayanan et al. 2021 (PipeDream-Flush): p warm-up micro-batches on stage 0")),
    "interleaved": ScheduleFacts("interleaved", 2, "interleaved 1F1B", "ScheduleInterleaved1F1B",
                                 takes_chunks=True),
    "zb_h1": ScheduleFacts("interleaved", 1, "ZB-H1", "ScheduleInterleavedZeroBubble", peak=Peak(
        "p", lambda p: p,
        "Qi et al. 2024, ZB-H1: 1F1B's count on stage 0; holds when W keeps less than B "
        "(their Table 1: 32sbh against 34sbh + 5as^2b per layer)")),
    "zb_h2": ScheduleFacts("interleaved", 1, "ZB-H2", peak=Peak(
        "2p-1", lambda p: 2 * p - 1, "Qi et al. 2024, ZB-H2: 2p-1 warm-up forwards on stage 0")),
    "zb_v": ScheduleFacts("v", 2, "ZB-V", "ScheduleZBVZeroBubble", peak=Peak(
        "p", lambda p: p,
        "Qi et al. 2024, section 6 (ZB-V): 2p chunk micro-batches of half a stage, 1F1B's "
        "amount, on every rank")),
    "dualpipe_v": ScheduleFacts("v", 2, "DualPipeV", "ScheduleDualPipeV", peak=Peak(
        "p+1/2", lambda p: p + 0.5,
        "deepseek-ai/DualPipe README: PP+1 chunk micro-batches per device for PP = 2p chunk "
        "stages")),
}
