"""Point-to-point: ``send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv``, each
reported to the open meters and counted exactly (a send of ``S`` bytes puts ``S`` bytes on
the wire).

The layer every algorithm of :mod:`engine.comm` is built on (the ring, the tree, the parameter
server, the pairwise all-to-all, the counted collectives), and the one below the collectives
(:mod:`engine.comm.collectives`). Same arguments and semantics as the ``torch.distributed``
functions of the same name (ranks are global ranks, as there); :mod:`engine.comm.ops` re-exports
them for the rest of the engine. Also here: :func:`group_ranks`, :func:`nbytes`,
:class:`MeteredWork` (a work that stamps the completion time of its events) and host staging.

**Gloo with CUDA tensors.** Gloo takes CUDA tensors only in ``all_reduce`` and ``broadcast``
(the backend table of PyTorch's ``torch.distributed`` documentation). For every other op the
engine goes through host memory: the data is copied to a CPU tensor, the op runs there, and the
result is copied back (for an async op, when it is waited on or first seen completed). That is
what lets a one-GPU machine run the multi-rank lessons on Gloo with CUDA tensors. On NCCL, and
for CPU tensors, nothing is copied. :func:`stages_through_host` decides, :func:`staged` prepares
a collective's tensors (:mod:`engine.comm.collectives`).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from engine.observe import durations, nccl_rules
from engine.observe.meter import OPEN, CommEvent, record, recording

P2POp = dist.P2POp


def group_ranks(group=None) -> tuple[int, ...]:
    """Global ranks in ``group`` (the whole world when ``None``)."""
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class MeteredWork:
    """A ``dist.Work`` that stamps the completion time on its events.

    Where the backend gives the work a future (Gloo and NCCL collectives) the stamp is the
    moment the op completed, even if ``wait()`` comes much later, so overlapped communication
    shows its true duration. Point-to-point works are not asked (Gloo's have no future, and
    asking costs a C++ exception each time): they are stamped when ``wait()`` returns or
    ``is_completed()`` first says True (on Gloo, measured here, a receive's ``is_completed()``
    stays False until it is waited on, and so does an async reduce-scatter's).

    A host-staged result (see the module docstring) is copied back at the same moment, once.
    """

    __slots__ = ("_work", "_events", "_waited", "_result", "_after")

    def __init__(self, work, events: Sequence[CommEvent], has_future: bool = True,
                 after: Callable[[], None] | None = None):
        self._work, self._events = work, list(events)
        self._waited, self._result = False, None
        self._after = after  # copies a host-staged result back (see the module docstring)
        if has_future and self._events:  # nothing to stamp when no meter is open
            try:
                work.get_future().then(self._stamp)
            except RuntimeError:  # "Work::getFuture not implemented"
                pass

    def _stamp(self, _future=None) -> None:
        if not self._events:
            return
        now = time.perf_counter()
        for event in self._events:
            if event.end is None:
                event.end = now

    def _copy_back(self) -> None:
        if self._after is not None:
            after, self._after = self._after, None
            after()

    def wait(self, *args, **kwargs):
        # Waiting twice on a Gloo receive blocks until the timeout (measured here); waiting
        # twice on a MeteredWork returns at once, as it does on a collective.
        if not self._waited:
            self._result = self._work.wait(*args, **kwargs)
            self._waited = True
            self._stamp()
            mark_gpu_end(self._events)
            self._copy_back()
        return self._result

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        if done:
            self._stamp()
            self._copy_back()
        return done

    def __getattr__(self, name):  # exception(), get_future(), ...
        return getattr(self._work, name)


def nccl_times(tensor: torch.Tensor, group=None) -> bool:
    """True where the op's work can time itself (a CUDA tensor on an NCCL group): its events
    keep the work, asked for NCCL's own duration when the meter closes
    (:mod:`engine.observe.durations`). Asked only while a meter is open."""
    return tensor.is_cuda and dist.get_backend(group) == "nccl"


def mark_gpu_end(events: Sequence[CommEvent]) -> None:
    """Mark completion on the stream of events whose start was marked there: after ``wait``,
    the current stream waits for the op, so the mark fires when it is done."""
    for event in events:
        if len(event.gpu_marks) == 1:
            event.gpu_marks.append(OPEN.gpu_mark(event.gpu_marks[0][0]))


# -- Gloo with CUDA tensors: through host memory ----------------------------------------------


def stages_through_host(tensor: torch.Tensor, group=None) -> bool:
    """True where an op other than all_reduce/broadcast on ``tensor`` must go through host
    memory: a CUDA tensor on a Gloo group."""
    return not tensor.is_cpu and dist.get_backend(group) == "gloo"


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def _host_buffer(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype)


def staged(out: torch.Tensor, inp: torch.Tensor | None, group):
    """``(out', inp', copy_back)`` for an op writing ``out`` from ``inp`` (``None``: in place):
    host tensors and the function that copies the result back, or the tensors themselves and
    ``None`` when no staging is needed."""
    if not stages_through_host(out if inp is None else inp, group):
        return out, inp, None
    if inp is None:
        host = _host_copy(out)
        return host, None, lambda: out.copy_(host)
    host_out = _host_buffer(out)
    return host_out, _host_copy(inp), lambda: out.copy_(host_out)


# -- point to point: counted exactly ---------------------------------------------------------


def _p2p_events(kind: str, tensor: torch.Tensor, peer: int, group, start: float
                ) -> list[CommEvent]:
    """The op's event, recorded by every open meter, in a list; empty when no meter is open
    (nobody would read it, and building it costs time on every message: benchmarks/README.md).
    """
    if not recording():
        return []
    size = nbytes(tensor)
    return [record(
        CommEvent(
            op=kind,
            group=group_ranks(group),
            payload_bytes=size,
            bytes_sent=size if kind in ("send", "isend") else 0,
            bytes_received=size if kind in ("recv", "irecv") else 0,
            measured=True,
            algorithm="p2p",
            start=start,
            peer=peer,
            dtype=str(tensor.dtype),
        )
    )]


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> None:
    nccl_rules.check("send", [tensor], group, tag=tag)
    events = _p2p_events("send", tensor, dst, group, time.perf_counter())
    wire = _host_copy(tensor) if stages_through_host(tensor, group) else tensor
    if events and nccl_times(tensor, group):  # dist.send's own steps, keeping the work
        pg, peer = process_group_and_rank(group, dst)
        work = pg.send([_real(wire)], peer, tag)
        durations.attach(events, work, tensor.device)
        work.wait()
    else:
        dist.send(wire, dst, group=group, tag=tag)
    for event in events:
        event.end = time.perf_counter()


def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0) -> int:
    """Receive into ``tensor`` from ``src`` (None: from whichever rank sends first); returns
    the sender's rank. ``tag`` tells apart messages between the same pair of ranks."""
    nccl_rules.check("recv", [tensor], group, src=src, tag=tag)
    events = _p2p_events("recv", tensor, src, group, time.perf_counter())
    if stages_through_host(tensor, group):
        wire = _host_buffer(tensor)
        sender = dist.recv(wire, src, group=group, tag=tag)
        tensor.copy_(wire)
    elif events and src is not None and nccl_times(tensor, group):  # dist.recv's own steps
        pg, peer = process_group_and_rank(group, src)
        work = pg.recv([_real(tensor)], peer, tag)
        durations.attach(events, work, tensor.device)
        work.wait()
        sender = src
    else:
        sender = dist.recv(tensor, src, group=group, tag=tag)
    for event in events:
        event.end, event.peer = time.perf_counter(), sender
    return sender


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> MeteredWork:
    nccl_rules.check("isend", [tensor], group, tag=tag)
    events = _p2p_events("isend", tensor, dst, group, time.perf_counter())
    wire = _host_copy(tensor) if stages_through_host(tensor, group) else tensor
    pg, peer = process_group_and_rank(group, dst)
    work = pg.send([_real(wire)], peer, tag)
    if events and nccl_times(tensor, group):
        durations.attach(events, work, tensor.device)
    return nccl_rules.unbatched_send(MeteredWork(work, events, has_future=False), dst, group)


def irecv(tensor: torch.Tensor, src: int, group=None, tag: int = 0) -> MeteredWork:
    nccl_rules.check("irecv", [tensor], group, src=src, tag=tag)
    events = _p2p_events("irecv", tensor, src, group, time.perf_counter())
    pg, peer = process_group_and_rank(group, src)
    if not stages_through_host(tensor, group):
        work = pg.recv([_real(tensor)], peer, tag)
        if events and nccl_times(tensor, group):
            durations.attach(events, work, tensor.device)
        return MeteredWork(work, events, has_future=False)
    wire = _host_buffer(tensor)
    return MeteredWork(pg.recv([_real(wire)], peer, tag), events, has_future=False,
                       after=lambda: tensor.copy_(wire))


def process_group_and_rank(group, rank: int):
    """The process group to call and ``rank``'s index in it.

    ``isend``/``irecv`` call the process group directly instead of going through
    ``dist.isend``/``dist.irecv``, whose Python (overrides, rank translation, checks) runs on
    every message (what that cost is in benchmarks/README.md). A peer outside ``group`` is
    refused as ``dist.isend`` refuses it; a rank outside ``group``, which ``dist.isend`` skips
    with a warning and a ``None`` work, gets a ValueError.
    """
    if group is None:
        return dist.group.WORLD, rank
    if dist.get_rank(group) < 0:
        raise ValueError(f"this rank ({dist.get_rank()}) is not in the group "
                         f"{group_ranks(group)}; only its members can send or receive on it")
    return group, dist.get_group_rank(group, rank)


def _real(tensor: torch.Tensor) -> torch.Tensor:
    """Complex tensors travel as their real view, as in ``dist.isend``."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def send_op(tensor: torch.Tensor, peer: int, group=None) -> P2POp:
    """A send for :func:`batch_isend_irecv`."""
    return P2POp(dist.isend, tensor, peer, group)


def recv_op(tensor: torch.Tensor, peer: int, group=None) -> P2POp:
    """A receive for :func:`batch_isend_irecv`."""
    return P2POp(dist.irecv, tensor, peer, group)


def batch_isend_irecv(p2p_ops: Sequence[P2POp]) -> list[MeteredWork]:
    """Issue sends and receives together (the way to post both sides of a ring step at once)."""
    for op in p2p_ops:
        nccl_rules.check("batch_isend_irecv", [op.tensor], op.group, tag=op.tag)
    start = time.perf_counter()
    events = [
        _p2p_events("isend" if op.op is dist.isend else "irecv", op.tensor, op.peer, op.group,
                    start)
        for op in p2p_ops
    ]
    wire_ops, copy_backs = [], []
    for op in p2p_ops:
        if not stages_through_host(op.tensor, op.group):
            wire_ops.append(op)
            copy_backs.append(None)
        elif op.op is dist.isend:
            wire_ops.append(P2POp(op.op, _host_copy(op.tensor), op.peer, op.group, op.tag))
            copy_backs.append(None)
        else:
            wire = _host_buffer(op.tensor)
            wire_ops.append(P2POp(op.op, wire, op.peer, op.group, op.tag))
            copy_backs.append(lambda t=op.tensor, w=wire: t.copy_(w))
    works = dist.batch_isend_irecv(wire_ops)
    if len(works) != len(events):  # NCCL coalesces a batch into one work for all its ops
        flat = [e for op_events in events for e in op_events]
        if flat and all(nccl_times(op.tensor, op.group) for op in p2p_ops):
            for w in works:
                durations.attach(flat, w, p2p_ops[0].tensor.device)
        return [MeteredWork(w, flat) for w in works]
    for op, w, op_events in zip(p2p_ops, works, events, strict=True):
        if op_events and nccl_times(op.tensor, op.group):
            durations.attach(op_events, w, op.tensor.device)
    return [MeteredWork(w, e, has_future=False, after=c)
            for w, e, c in zip(works, events, copy_backs, strict=True)]
