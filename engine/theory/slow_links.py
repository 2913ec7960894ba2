"""Training across slow links and failures (chapter 11): DiLoCo, HSDP, checkpoint intervals.

Part of :mod:`engine.theory`: pure formulas, each naming its source; sizes in bytes.
"""

from __future__ import annotations

import math

from engine.validation import positive_int
from engine.theory.collectives import ring_all_reduce_bytes


def diloco_syncs(steps: int, sync_every: int, fragments: int = 1) -> list[int]:
    """How many syncs each fragment starts in ``steps`` inner steps of streaming DiLoCo
    (Douillard et al., 2025, section 2.2): fragment ``p`` syncs at the steps
    ``t ≡ (p+1)·H/F (mod H)``, ``1 <= t <= steps``; ``F = 1`` is DiLoCo's every ``H`` steps
    (Douillard et al., 2023, Algorithm 1)."""
    positive_int("sync_every", sync_every)
    positive_int("fragments", fragments)
    stagger = sync_every // fragments
    counts = []
    for p in range(fragments):
        first = (p + 1) * stagger  # the first step t >= 1 with t ≡ offset (mod H)
        counts.append(0 if steps < first else (steps - first) // sync_every + 1)
    return counts


def diloco_bytes(numel: int, steps: int, sync_every: int, n: int, dtype_bytes: float = 4,
                 fragments: int = 1) -> float:
    """Bytes each replica sends in ``steps`` inner steps of (streaming) DiLoCo: every sync of a
    fragment of ``numel / F`` elements is one ring all-reduce of its pseudo-gradient,
    ``2(n-1)/n · numel/F · dtype_bytes`` (Douillard et al., 2023, Algorithm 1; 2025 for the
    fragments). Data parallelism sends ``2(n-1)/n · numel · 4`` every step: DiLoCo cuts it by
    ``H`` (and by 2 more with a bf16 outer all-reduce)."""
    return sum(diloco_syncs(steps, sync_every, fragments)) * \
        diloco_peak_sync_bytes(numel, n, dtype_bytes, fragments)


def diloco_peak_sync_bytes(numel: int, n: int, dtype_bytes: float = 4,
                           fragments: int = 1) -> float:
    """Bytes one replica sends in one sync: ``2(n-1)/n · numel/F · dtype_bytes``. Streaming
    DiLoCo's point (Douillard et al., 2025, section 2.2): the peak bandwidth falls by ``F``."""
    positive_int("fragments", fragments)
    return ring_all_reduce_bytes(numel / fragments * dtype_bytes, n)


def hsdp_replica_bytes(numel: int, shard: int, replicas: int, dtype_bytes: float = 4) -> float:
    """Bytes each rank sends across the replica dimension per step in HSDP (hybrid sharding:
    ZeRO-3 inside a group of ``shard`` ranks, replicated over ``replicas`` groups; Zhao et al.,
    "PyTorch FSDP", VLDB 2023, section 3.2.2): each rank all-reduces only its reduce-scattered
    shard, ``2(R-1)/R · numel/S · dtype_bytes``, the ``S``-th of what data parallelism sends
    across the same links (``2(R-1)/R · numel · dtype_bytes``). The paper gives the cross-host
    traffic per GPU as ``2M(W-1)/(GW)`` for ``M`` bytes of model on ``W`` GPUs in hosts of
    ``G``; with ``M = numel · dtype_bytes``, ``W = R·S`` and ``G = S`` the ring over the ``R``
    replicas counted here is ``2M(W-S)/(SW)``, a little less, and the two meet as ``W/S``
    grows."""
    positive_int("shard", shard)
    return ring_all_reduce_bytes(numel / shard * dtype_bytes, replicas)


def young_checkpoint_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """The compute time between checkpoints that wastes the least, to first order:
    ``sqrt(2·C·M)`` for a checkpoint that costs ``C`` seconds and failures ``M`` seconds apart
    on average (Young, "A first order approximation to the optimum checkpoint interval",
    CACM 17(9), 1974). The waste per second is about ``C/T + T/(2M)``: the checkpoints, and
    half an interval of lost work per failure."""
    from engine.validation import positive_number
    positive_number("checkpoint_s", checkpoint_s)
    positive_number("mtbf_s", mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def checkpoint_waste(interval_s: float, checkpoint_s: float, mtbf_s: float) -> float:
    """The first-order share of wall time wasted when checkpointing every ``interval_s``
    seconds of compute (Young, 1974): ``C/T`` writing checkpoints plus ``T/(2M)``, the half
    interval of work lost per failure on average. Least at ``T = sqrt(2CM)``
    (:func:`young_checkpoint_interval`), where it is ``sqrt(2C/M)``."""
    from engine.validation import positive_number
    positive_number("interval_s", interval_s)
    positive_number("checkpoint_s", checkpoint_s)
    positive_number("mtbf_s", mtbf_s)
    return checkpoint_s / interval_s + interval_s / (2 * mtbf_s)


def daly_checkpoint_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (Daly, "A higher order estimate of the optimum checkpoint
    interval for restart dumps", FGCS 22(3), 2006, eq. 37): for ``C < 2M``,
    ``sqrt(2CM)·(1 + sqrt(C/2M)/3 + (C/2M)/9) - C``; else ``M``."""
    young = young_checkpoint_interval(checkpoint_s, mtbf_s)
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    x = checkpoint_s / (2 * mtbf_s)
    return young * (1 + math.sqrt(x) / 3 + x / 9) - checkpoint_s
