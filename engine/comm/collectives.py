"""The collectives: the built-in (bytes modeled) or the engine's own (bytes counted).

``all_reduce``, ``broadcast``, ``reduce``, ``reduce_scatter_tensor``,
``all_gather_into_tensor``, ``all_to_all_single`` and ``barrier``, with the arguments and
semantics of the ``torch.distributed`` functions of the same name, each reported to the open
meters as one :class:`~engine.observe.meter.CommEvent`. Normally the built-in collective of Gloo or
NCCL runs and the event holds the wire model's bytes (:func:`engine.theory.collective_wire_bytes`).
Inside ``CommMeter(count="wire")`` the same call runs the engine's own algorithm of
:mod:`engine.comm.counted`, built from point-to-point messages, and the event holds the bytes
those messages carried.

The top layer of :mod:`engine.comm`, on the algorithms and point-to-point
(:mod:`engine.comm.p2p`, whose host staging lets Gloo run them on CUDA tensors);
:mod:`engine.comm.ops` re-exports it for the rest of the engine.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from engine import theory
from engine.comm import counted
from engine.observe import durations, nccl_rules
from engine.observe.meter import (OPEN, CommEvent, collecting_messages, counting_wire, record,
                               recording)
from engine.comm.p2p import (MeteredWork, group_ranks, mark_gpu_end, nbytes, nccl_times,
                             staged)

ReduceOp = dist.ReduceOp
# torch 2.13 renamed these (the old names still work, with a FutureWarning).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CompletedWork:
    """The work of a counted collective, which ran to completion before it was returned."""

    def __init__(self, result):
        self._result = result

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self):
        future = torch.futures.Future()
        future.set_result(self._result)
        return future

    def exception(self):
        return None


# the algorithm each collective's bytes follow: counted, or modeled for the built-in
_ALGORITHM = {"broadcast": "chain", "reduce": "chain", "all_to_all": "pairwise"}


def _collective(
    op: str, payload: torch.Tensor, full_bytes: int, group, root: int | None, run, async_op: bool,
    after: Callable[[], None] | None = None, counted: Callable[[], None] | None = None,
    modeled_bytes: tuple[int, int] | None = None,
):
    """Run one collective and record its event.

    Inside ``CommMeter(count="wire")``, ``counted()`` runs the engine's point-to-point version
    and the event holds the bytes of its messages. Otherwise ``run(async_op)`` runs the built-in
    (``after`` copies a host-staged result back) and the event holds the wire model's bytes
    (``modeled_bytes``, or :func:`engine.theory.collective_wire_bytes`). With no meter open
    nothing is recorded: no event, no CUDA event, only the built-in.
    """
    if dist.get_rank(group) < 0:  # not a member: torch makes this a no-op, and so do we
        return run(async_op)
    if not recording():
        work = run(async_op)
        if async_op:
            return MeteredWork(work, [], has_future=False, after=after)
        if after is not None:
            after()
        return None
    ranks = group_ranks(group)
    me = ranks.index(dist.get_rank())
    if counted is not None and counting_wire():
        return _run_counted(op, payload, ranks, root, counted, async_op)
    timed_by_nccl = nccl_times(payload, group)
    root_index = ranks.index(root) if root is not None else 0
    sent, received = modeled_bytes or theory.collective_wire_bytes(
        op, full_bytes, len(ranks), me, root_index)
    event = record(
        CommEvent(
            op=op,
            group=ranks,
            payload_bytes=nbytes(payload),
            bytes_sent=sent,
            bytes_received=received,
            measured=False,
            algorithm=_ALGORITHM.get(op, "ring"),
            start=time.perf_counter(),
            peer=root,
            dtype=str(payload.dtype),
        )
    )
    if payload.is_cuda:
        event.gpu_marks.append(OPEN.gpu_mark(payload.device))
    if timed_by_nccl:  # keep the work, for NCCL's own duration (dist's sync op waits on it)
        work = run(True)
        durations.attach([event], work, payload.device)
        if async_op:
            return MeteredWork(work, [event], after=after)
        work.wait()
    else:
        work = run(async_op)
        if async_op:
            return MeteredWork(work, [event], after=after)
    if after is not None:
        after()
    event.end = time.perf_counter()
    mark_gpu_end([event])
    return None


def _run_counted(op: str, payload: torch.Tensor, ranks, root, counted, async_op: bool):
    """Run ``counted()`` and record one event made of the messages it sent and received."""
    start = time.perf_counter()
    marks = [OPEN.gpu_mark(payload.device)] if payload.is_cuda else []
    with collecting_messages() as messages:
        counted()
    event = record(CommEvent(
        op=op, group=ranks, payload_bytes=nbytes(payload),
        bytes_sent=sum(m.bytes_sent for m in messages),
        bytes_received=sum(m.bytes_received for m in messages),
        measured=True, algorithm=_ALGORITHM.get(op, "ring"), start=start,
        end=time.perf_counter(), peer=root, dtype=str(payload.dtype), messages=len(messages),
        gpu_marks=marks, works=durations.distinct_works(messages)))
    mark_gpu_end([event])  # each message was waited on: the stream has waited for them all
    return CompletedWork([payload]) if async_op else None


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    nccl_rules.check("all_reduce", [tensor], group)
    return _collective(
        "all_reduce", tensor, nbytes(tensor), group, None,
        lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a), async_op,
        counted=lambda: counted.all_reduce(tensor, op, group))


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    nccl_rules.check("broadcast", [tensor], group)
    return _collective(
        "broadcast", tensor, nbytes(tensor), group, src,
        lambda a: dist.broadcast(tensor, src, group=group, async_op=a), async_op,
        counted=lambda: counted.broadcast(tensor, src, group))


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False):
    nccl_rules.check("reduce", [tensor], group)
    wire, _, after = staged(tensor, None, group)
    return _collective(
        "reduce", tensor, nbytes(tensor), group, dst,
        lambda a: dist.reduce(wire, dst, op=op, group=group, async_op=a), async_op, after,
        counted=lambda: counted.reduce(tensor, dst, op, group))


def reduce_scatter_tensor(
    output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False
):
    nccl_rules.check("reduce_scatter_tensor", [output, input], group)
    out, inp, after = staged(output, input, group)
    return _collective(
        "reduce_scatter", input, nbytes(input), group, None,
        lambda a: _reduce_scatter(out, inp, op=op, group=group, async_op=a), async_op, after,
        counted=lambda: counted.reduce_scatter(output, input, op, group))


def all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False
):
    nccl_rules.check("all_gather_into_tensor", [output, input], group)
    out, inp, after = staged(output, input, group)
    return _collective(
        "all_gather", input, nbytes(output), group, None,
        lambda a: _all_gather(out, inp, group=group, async_op=a), async_op, after,
        counted=lambda: counted.all_gather(output, input, group))


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group=None,
                      async_op: bool = False):
    """Rank i's input piece j (along dim 0) lands in rank j's output, piece i.

    The modeled bytes are the pairwise exchange's: a rank sends its input less the piece it
    keeps, and receives its output less that piece (``theory.all_to_all_bytes``).
    """
    nccl_rules.check("all_to_all_single", [output, input], group)
    ranks = group_ranks(group)
    if dist.get_rank() in ranks:
        n, me = len(ranks), ranks.index(dist.get_rank())
        row_bytes = nbytes(input) // max(input.shape[0], 1)
        kept_in = (input_split_sizes[me] if input_split_sizes else input.shape[0] // n)
        kept_out = (output_split_sizes[me] if output_split_sizes else output.shape[0] // n)
        modeled = (nbytes(input) - kept_in * row_bytes, nbytes(output) - kept_out * row_bytes)
    else:
        modeled = (0, 0)
    out, inp, after = staged(output, input, group)
    return _collective(
        "all_to_all", input, nbytes(input), group, None,
        lambda a: dist.all_to_all_single(out, inp, output_split_sizes, input_split_sizes,
                                         group=group, async_op=a),
        async_op, after,
        counted=lambda: counted.all_to_all(output, input, output_split_sizes,
                                           input_split_sizes, group),
        modeled_bytes=modeled)


def barrier(group=None) -> None:
    _collective("barrier", torch.empty(0), 0, group, None,
                lambda a: dist.barrier(group=group, async_op=a), False)
