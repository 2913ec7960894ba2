"""Chapter 09's drivers: what runs in the grading worker, next to the learner's code.

Each ``..._on_rank`` function here is a rank's body for :func:`engine.grading.core.run_ranks`:
it runs in the ranks the grading worker starts, with the learner's function among its
arguments, cuts this rank's share of the inputs, calls the learner's function (under the meter
where the traffic counts) and returns only what it observed (the output, the bytes sent, the
meter's events, an exception's message) as plain data. No comparison and no reference belongs
here: a submission can patch anything in the worker, so every verdict is computed in the
grader, in :mod:`engine.grading.chapters.ch09`, against attention it computes itself. The
inputs (Q, K and V over the whole sequence, a rank's rows) are defined here, once, for both
sides.

This module's name does not start with "ch", so :mod:`engine.grading.chapters` does not take
it for a chapter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.observe.meter import CommMeter

RING_BATCH, RING_HEADS, RING_HEAD_DIM, RING_SEQ_PER_RANK = 2, 2, 8, 3
ULYSSES_BATCH, ULYSSES_PER_RANK, ULYSSES_HEAD_DIM = 2, 3, 4


def rank_rows(rank: int, per_rank: int) -> slice:
    return slice(rank * per_rank, (rank + 1) * per_rank)


def _tensor_or_none(out):
    return out.detach().clone() if isinstance(out, torch.Tensor) else None


def ring_qkv(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K and V over the whole sequence of ``n`` ranks."""
    g = torch.Generator().manual_seed(3)
    return tuple(torch.randn(RING_BATCH, RING_HEADS, n * RING_SEQ_PER_RANK, RING_HEAD_DIM,
                             generator=g) for _ in range(3))


def ring_on_rank(rank, world_size, impl):
    """A driver (runs where the learner's code does): the learner's output for this rank's
    queries, and what the meter saw; compared with attention computed in the grader."""
    rows = rank_rows(rank, RING_SEQ_PER_RANK)
    q, k, v = (t[..., rows, :].contiguous() for t in ring_qkv(world_size))
    with CommMeter(count="wire") as meter:
        out = impl(q, k, v)
    return dict(out=_tensor_or_none(out), sent=meter.bytes_sent,
                events=[(e.op, e.peer) for e in meter.events])


def ulysses_qkv(n: int, heads: int, kv_heads: int):
    """Q (``heads`` heads), K and V (``kv_heads`` heads) over the whole sequence of ``n``
    ranks."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(ULYSSES_BATCH, heads, n * ULYSSES_PER_RANK, ULYSSES_HEAD_DIM, generator=g)
    k, v = (torch.randn(ULYSSES_BATCH, kv_heads, n * ULYSSES_PER_RANK, ULYSSES_HEAD_DIM,
                        generator=g) for _ in range(2))
    return q, k, v


def ulysses_on_rank(rank, world_size, impl, heads, kv_heads):
    """A driver (runs where the learner's code does): the learner's output for this rank's
    rows, and what the meter saw; compared with attention computed in the grader."""
    rows = rank_rows(rank, ULYSSES_PER_RANK)
    q, k, v = (t[..., rows, :].contiguous()
               for t in ulysses_qkv(world_size, heads, kv_heads))
    with CommMeter(count="wire") as meter:
        out = impl(q, k, v)
    return dict(out=_tensor_or_none(out), sent=meter.bytes_sent,
                ops=[e.op for e in meter.events])


def bad_degree_on_rank(rank, world_size, impl):
    """A driver (runs where the learner's code does): the ValueError's message, or None.

    No rank leaves before every rank has called the learner's function: a right answer raises
    before any communication, so without the barrier a rank could return, and its process end,
    closing its Gloo connections, while its peer was still joining the process group; the
    peer then failed in Gloo's connectFullMesh ("Connection closed by peer"), on a loaded
    machine only, and the check with it. (engine.launch now waits for every rank to join before
    any runs ``fn``; this keeps the check independent of when the ranks get there either way.)
    """
    q = torch.randn(1, 3, 2, 4)
    k = torch.randn(1, 1, 2, 4)
    try:
        impl(q, k, k)
    except ValueError as e:
        message = str(e)
    else:
        message = None
    if dist.is_initialized():
        dist.barrier()
    return message
