"""How evenly ring attention spreads causal work: FLOPs counted and seconds measured per rank.

Under a causal mask a rank computes only the (query chunk, key chunk) blocks at or below the
diagonal (:func:`engine.cp.ring.block_pairs`). In the contiguous layout rank ``r`` computes
``r + 1`` blocks, so the last rank works about twice as long as the average while the first
waits; in the zig-zag layout every rank computes the same ``2N + 1`` smaller blocks
(:func:`engine.theory.ring_attention_flops`).

Two conventions count a block on the causal diagonal. The engine computes it whole and masks
it (``skip_masked=False``: the ratios ``2N/(N+1)`` and ``4N/(2N+1)``); a FlashAttention-style
kernel skips its masked half (``skip_masked=True``: a diagonal block of ``c`` queries costs
``c(c+1)/2`` pairs, a striped block below the diagonal ``c(c-1)/2``). The ring moves in
lock-step, so its time is the sum over steps of the busiest rank's work in that step
(:func:`critical_path`): under the kernel convention ``(4N-2)c^2 + c`` pairs contiguous against
``2N c^2 + c`` zig-zag (``c = S/2N``), a speed-up tending to ``2 - 1/N``
(:func:`engine.theory.ring_critical_path`). The striped layout (Brandon et al. 2023) does half
a block on every rank at every step; counted whole, its blocks are the contiguous layout's.

The seconds are measured by running each rank's own schedule with the ring's own kernels
(:func:`engine.cp.blocks.block_forward` and :func:`~engine.cp.blocks.merge`), one rank after
another in this process on one thread: that is the time a rank spends computing, free of the
ranks sharing the machine's cores. The ring finishes no sooner than its busiest rank.
"""

from __future__ import annotations

import math
import time

import torch

from engine.cp.blocks import BELOW, DIAGONAL, block_forward, merge
from engine.cp.layout import check_sequence_split
from engine.cp.ring import ring_schedule


def rank_flops(seq: int, n: int, layout: str, causal: bool = True, batch: int = 1,
               heads: int = 1, head_dim: int = 1) -> list[float]:
    """Forward FLOPs each rank executes, counted from the ring's schedule."""
    chunk = check_sequence_split(seq, n, layout)
    return [4 * batch * heads * head_dim * chunk * chunk * sum(len(pairs) for pairs in steps)
            for steps in ring_schedule(n, layout, causal).values()]


def _pairs(kind: str, chunk: int, skip_masked: bool) -> int:
    if skip_masked and kind == DIAGONAL:
        return chunk * (chunk + 1) // 2
    if skip_masked and kind == BELOW:
        return chunk * (chunk - 1) // 2
    return chunk * chunk


def rank_step_pairs(seq: int, n: int, layout: str, causal: bool = True,
                    skip_masked: bool = False) -> dict[int, list[int]]:
    """``{rank: [query-key pairs computed at step 0, 1, ...]}`` from the ring's schedule; a
    diagonal block whole (``skip_masked=False``, what the engine computes) or only its visible
    pairs (``True``, a FlashAttention-style kernel)."""
    chunk = check_sequence_split(seq, n, layout)
    return {rank: [sum(_pairs(kind, chunk, skip_masked) for _, _, kind in pairs)
                   for pairs in steps]
            for rank, steps in ring_schedule(n, layout, causal).items()}


def critical_path(seq: int, n: int, layout: str, causal: bool = True,
                  skip_masked: bool = False) -> int:
    """Query-key pairs on the ring's critical path: each step waits for its busiest rank."""
    per_rank = rank_step_pairs(seq, n, layout, causal, skip_masked)
    return sum(max(steps[s] for steps in per_rank.values()) for s in range(n))


def rank_seconds(seq: int, n: int, layout: str, causal: bool = True, batch: int = 1,
                 heads: int = 4, head_dim: int = 32, repeats: int = 3) -> list[float]:
    """Seconds each rank spends in the forward's block arithmetic (best of ``repeats``)."""
    chunk = check_sequence_split(seq, n, layout)
    per_rank = seq // n
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, per_rank, head_dim, generator=g).chunk(per_rank // chunk, -2)
    k = torch.randn(batch, heads, per_rank, head_dim, generator=g).chunk(per_rank // chunk, -2)
    scale = 1 / math.sqrt(head_dim)

    def run(steps) -> float:
        outs = [torch.zeros_like(c) for c in q]
        lses = [torch.full(c.shape[:-1], float("-inf")) for c in q]
        start = time.perf_counter()
        for pairs in steps:
            for a, b, kind in pairs:
                outs[a], lses[a] = merge(outs[a], lses[a],
                                         *block_forward(q[a], k[b], k[b], scale, kind))
        return time.perf_counter() - start

    schedule = ring_schedule(n, layout, causal)
    best = [float("inf")] * n
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core, as each rank has; a second thread waiting on a busy
    try:                      # core made single blocks 100x slower here
        for _ in range(repeats):  # ranks interleaved: a slow moment does not hit one rank only
            for rank, steps in schedule.items():
                best[rank] = min(best[rank], run(steps))
    finally:
        torch.set_num_threads(threads)
    return best


def imbalance(per_rank: list[float]) -> float:
    """The busiest rank's load over the average: 1 is perfect balance."""
    return max(per_rank) / (sum(per_rank) / len(per_rank))
