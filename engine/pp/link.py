"""A pipeline rank's messages: activations forward, gradients backward, received in the order
they were sent.

NCCL ignores tags: the messages between two ranks match in the order they were sent. A rank
may need them in another order (an interleaved or V-shaped schedule sends activations and
gradients over the same pair of ranks), so :class:`Link` receives each peer's messages in
that peer's send order, which it reads from the schedule (every rank knows the whole
schedule), and keeps the ones that arrive before they are needed. Sends are posted
(``isend``) and completed by :meth:`Link.finish`; a receive never waits for a message that
is not already sent or about to be, so a schedule that :func:`engine.pp.validate` accepts
cannot deadlock here. A tensor travels as a small shape message, then its data: any shapes
work. A message a rank sends to itself (the middle of a V, or a one-rank pipeline) is handed
over locally as a detached copy, as a receiver would get it.
"""

from __future__ import annotations

from collections import deque

import torch

from engine.comm import ops
from engine.pp.schedules import messages

_MAX_DIMS = 8
# bytes of the shape message sent before every tensor: its rank and up to 8 sizes, in int64
SHAPE_HEADER_BYTES = (_MAX_DIMS + 1) * 8


class Link:
    """Point-to-point traffic of pipeline rank ``stage`` (``ranks``: the pipeline group's
    global ranks) for ``schedule``. A message is ``("act" | "grad", mb, virtual stage that
    sends)``."""

    def __init__(self, schedule, stage: int, ranks, group, placement: str,
                 dtype: torch.dtype, device: torch.device):
        self.stage, self.ranks, self.group = stage, ranks, group
        self.dtype, self.device = dtype, device
        self.incoming: dict[int, deque] = {}  # peer -> its messages to us, in its send order
        for sender, receiver, msg in messages(schedule, placement):
            if receiver == stage and sender != stage:
                self.incoming.setdefault(sender, deque()).append(msg)
        self.early: dict[tuple, torch.Tensor] = {}  # received before they were needed
        self.local: dict[tuple, torch.Tensor] = {}
        self.pending: list = []

    def send(self, tensor: torch.Tensor, msg: tuple, to: int) -> None:
        if to == self.stage:
            self.local[msg] = tensor.detach().clone()
            return
        shape = torch.zeros(_MAX_DIMS + 1, dtype=torch.int64, device=tensor.device)
        shape[0] = tensor.dim()
        shape[1:1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64,
                                                 device=tensor.device)
        data = tensor.detach().contiguous()
        dst = self.ranks[to]
        self.pending += [(ops.isend(shape, dst, self.group), shape),
                         (ops.isend(data, dst, self.group), data)]

    def receive(self, msg: tuple, sender: int) -> torch.Tensor:
        if sender == self.stage:
            return self.local.pop(msg)
        while msg not in self.early:
            self.early[self.incoming[sender].popleft()] = self._recv(self.ranks[sender])
        return self.early.pop(msg)

    def _recv(self, src: int) -> torch.Tensor:
        shape = torch.empty(_MAX_DIMS + 1, dtype=torch.int64, device=self.device)
        ops.recv(shape, src, self.group)
        out = torch.empty(tuple(shape[1:1 + int(shape[0])].tolist()), dtype=self.dtype,
                          device=self.device)
        ops.recv(out, src, self.group)
        return out

    def finish(self) -> None:
        """Wait for every send to complete."""
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
