"""Chapter 12's drivers: what runs in the grading worker, next to the learner's code.

Each function here runs where the learner's code lives, with the learner's module or function
among its arguments: ``gather_on_rank`` is a rank's body for
:func:`engine.grading.core.run_ranks`, ``dequantized`` and ``flops_on`` are run by
:func:`engine.grading.core.run_here`. Each builds what the learner's function needs, calls it
and returns only what it observed (a tensor, the meter's events, the FLOPs torch counted) as
plain data. No comparison and no reference belongs here: a submission can patch anything in
the worker, so every verdict is computed in the grader, in
:mod:`engine.grading.chapters.ch12`, against references it computes itself.

This module's name does not start with "ch", so :mod:`engine.grading.chapters` does not take
it for a chapter.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from engine.observe.meter import CommMeter


def gather_on_rank(rank, world_size, module, chunks):
    """A driver (runs where the learner's code does): gather_dim0 on this rank's chunk of each
    parameter (the chunks made in the grader). It returns what it saw: the tensor returned and
    the meter's events; the check compares them in the grader with the full parameter."""
    results = []
    for shape, chunk in chunks[rank]:
        with CommMeter() as meter:
            got = module.gather_dim0(chunk.clone(), shape[0])
        results.append(dict(got=got.detach().clone() if isinstance(got, torch.Tensor) else None,
                            got_shape=tuple(getattr(got, "shape", ())),
                            ops=[(e.op, e.bytes_sent) for e in meter.events]))
    return results


def dequantized(module, q_bits, scales, tile):
    """A driver (runs where the learner's code does): dequantize_tiles on the E4M3 tensor whose
    bits are ``q_bits`` (a float8 tensor does not survive a pickle, its bytes do)."""
    return module.dequantize_tiles(q_bits.view(torch.float8_e4m3fn), scales, tile)


def flops_on(impl, g):
    """A driver (runs where the learner's code does): the FLOPs torch counted while the
    learner's function ran on ``g``."""
    with FlopCounterMode(display=False) as counter:
        impl(g)
    return counter.get_total_flops()
