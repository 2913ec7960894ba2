"""A pipeline rank's messages: activations forward, gradients backward, posted in batches that
cannot deadlock on NCCL.

**Why batches.** On NCCL the unbatched sends and receives between two ranks share one stream.
In 1F1B's steady state each stage sends (an activation forward, a gradient back) while its
neighbour does the same towards it: each send then waits for a receive queued behind the
other's send, a deadlock as soon as a message outgrows NCCL's buffers (about 1-4 MiB). NCCL's
documentation says the operations of one group never block each other, so, as PyTorch's
pipelining and Megatron-LM's ``send_forward_recv_backward`` (Narayanan et al., SC 2021) do,
every message here goes through ``batch_isend_irecv``, and a send and its receive are always
posted in *matching* batches: :func:`plan_rounds` plays the schedule in rounds, in each of
which every rank posts at most one batch and then runs its next action if its input is there.
A message is sent in the round its receiver waits for it, or earlier when its sender posts a
batch anyway (to receive); the receiver takes every message sent to it in the round, needed
now or kept for later. Every operation of a round's batch is matched within that round's
batches, so a rank waits on a batch only for batches its peers post at the same round: no
wait cycle, even with NCCL's strictest behaviour (a send completes only when its receive is
posted; a rank's batches run in order), which :func:`rendezvous_deadlock` replays. In 1F1B's
steady state the rounds are Megatron's ``send_forward_recv_backward`` and
``send_backward_recv_forward``. A batch holds sends without a receive only where nothing is
sent to the rank in that round (the first stage's warm-up, the last sends); no send is ever
posted outside a batch.

**Order.** NCCL ignores tags: the messages between two ranks match in the order they were
sent; each rank's receives from a peer are posted in that peer's send order (both follow the
same plan, which every rank computes from the whole schedule).

**Shapes, without a host sync per message.** A gradient has the shape of the activation it
belongs to, which the receiver itself sent. An activation's shape travels once per virtual
stage that sends it (per run): its first message is preceded by a :data:`SHAPE_HEADER_BYTES`
header (its rank and up to 8 sizes, int64), read once; every later micro-batch of that stage
must have the same shape (a ``ValueError`` on the sender otherwise). A message a rank sends
to itself (the middle of a V, or a one-rank pipeline) is handed over locally as a detached
copy, as a receiver would get it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.comm import ops
from engine.pp.actions import rank_of, shape, virtual_stage
from engine.pp.schedules import needs, produces

_MAX_DIMS = 8
# bytes of the shape header sent once per sending virtual stage: rank and up to 8 sizes, int64
SHAPE_HEADER_BYTES = (_MAX_DIMS + 1) * 8


def plan_rounds(schedule, placement: str = "interleaved") -> dict[int, list[tuple]]:
    """Each rank's program for ``schedule`` (of :class:`engine.pp.Action` s): a list of
    ``("batch", sends, receives)`` (``sends``: ``[(message, to)]``, ``receives``:
    ``[(message, sender)]``, in order) and ``("run", action)``, by rounds (module docstring).
    """
    p, _, v = shape(schedule)
    last = p * v - 1
    at = {s: 0 for s in schedule}
    held: dict[int, list] = {s: [] for s in schedule}
    have: dict[int, set] = {s: set() for s in schedule}
    program: dict[int, list] = {s: [] for s in schedule}
    while any(at[s] < len(schedule[s]) or held[s] for s in schedule):
        waits_for = {}  # rank -> the message its next action waits for
        for s, actions in schedule.items():
            if at[s] < len(actions):
                action = actions[at[s]]
                need = needs(action, virtual_stage(s, action.chunk, p, placement), last)
                if need is not None and need not in have[s]:
                    waits_for[s] = need
        # a held send is due when its receiver waits for it; a rank that posts a batch anyway
        # takes all its held sends along, so that they pair with receives
        posting = {s for s in schedule if any(waits_for.get(to) == msg for msg, to in held[s])}
        grown = True
        while grown:
            receivers = {to for s in posting for _, to in held[s]}
            grown = not receivers <= posting
            posting |= receivers
        incoming: dict[int, list] = {s: [] for s in schedule}
        for s in schedule:
            if s in posting:
                for msg, to in held[s]:
                    incoming[to].append((msg, s))
        moved = False
        for s in schedule:
            sends = held[s] if s in posting else []
            if sends or incoming[s]:
                program[s].append(("batch", sends, incoming[s]))
                have[s].update(msg for msg, _ in incoming[s])
                moved = True
            if s in posting:
                held[s] = []
        for s, actions in schedule.items():
            if at[s] == len(actions):
                continue
            action = actions[at[s]]
            vs = virtual_stage(s, action.chunk, p, placement)
            need = needs(action, vs, last)
            if need is not None and need not in have[s]:
                continue
            program[s].append(("run", action))
            at[s], moved = at[s] + 1, True
            out = produces(action, vs, last)
            if out is not None:
                to = rank_of(out[2] + (1 if out[0] == "act" else -1), p, placement)
                if to == s:
                    have[s].add(out)
                else:
                    held[s].append((out, to))
        if not moved:
            stuck = {s: schedule[s][at[s]] for s in schedule if at[s] < len(schedule[s])}
            raise ValueError(f"the pipeline schedule cannot proceed: stages stuck at {stuck}")
    return program


CONNECTED_GROUPS: set = set()  # NCCL groups that have run a collective in this process


def connect(group, device: torch.device) -> None:
    """On NCCL, a one-element all-reduce on ``group`` the first time a pipeline uses it:
    PyTorch's ``batch_isend_irecv`` requires every rank of the group to take part in the
    group's first collective call, and a batch involves only two ranks. Every rank of the
    group builds its :class:`Link` at the same point, so they all take part."""
    key = id(group if group is not None else dist.group.WORLD)
    if key in CONNECTED_GROUPS or dist.get_backend(group) != "nccl":
        return
    ops.all_reduce(torch.zeros(1, device=device), group=group)
    CONNECTED_GROUPS.add(key)


class Link:
    """Point-to-point traffic of pipeline rank ``stage`` (``ranks``: the pipeline group's
    global ranks) for ``schedule`` (a :class:`engine.pp.registry.PipelineSchedule`, whose
    ``rounds`` :func:`plan_rounds` planned once). Iterate :meth:`actions` (each action comes
    after the batch that brings its input); in an action :meth:`receive` its input and
    :meth:`send` its output. A message is ``("act" | "grad", mb, virtual stage that sends)``."""

    def __init__(self, schedule, stage: int, ranks, group, dtype: torch.dtype,
                 device: torch.device):
        self.stage, self.ranks, self.group = stage, ranks, group
        self.dtype, self.device = dtype, device
        self.program = schedule.rounds[stage]
        self.inbox: dict[tuple, torch.Tensor] = {}  # received (or handed over locally)
        self.outbox: dict[tuple, torch.Tensor] = {}  # sent by an action, posted next round
        self.shapes: dict[int, tuple] = {}  # sending virtual stage -> its activations' shape
        self.known: dict[int, tuple] = {}  # shapes a dry run knows (its headers hold no values)
        self.announced: dict[int, tuple] = {}  # our virtual stages whose shape has travelled
        self.sent_shapes: dict[tuple, tuple] = {}  # (mb, vs) -> shape of the act we sent
        self.log: list[tuple] = []  # ("post", [(op, peer, message, part)]) | ("wait", index)
        connect(group, device)

    def actions(self):
        """This rank's actions, in order, each after the batches before it; then the last."""
        for item in self.program:
            if item[0] == "run":
                yield item[1]
            else:
                self._round(item[1], item[2])

    def send(self, tensor: torch.Tensor, msg: tuple, to: int) -> None:
        """Keep ``tensor`` (message ``msg`` for pipeline rank ``to``) for the next batch."""
        data = tensor.detach()
        if to == self.stage:
            self.inbox[msg] = data.clone()
            return
        data = data.contiguous()
        if msg[0] == "act":
            self.sent_shapes[msg[1], msg[2]] = tuple(data.shape)
            known = self.announced.get(msg[2])
            if known is not None and known != tuple(data.shape):
                raise ValueError(f"virtual stage {msg[2]} sends activations of shape "
                                 f"{tuple(data.shape)} for micro-batch {msg[1]}, but "
                                 f"{known} before: every micro-batch of a pipeline must "
                                 "have the same shape (its shape travels once per run)")
        self.outbox[msg] = data

    def receive(self, msg: tuple, sender: int) -> torch.Tensor:
        """Message ``msg`` (from pipeline rank ``sender``), received in an earlier batch."""
        return self.inbox.pop(msg)

    def _round(self, sends: list, receives: list) -> None:
        """This rank's batch of a round: ``sends`` and ``receives``. A receive whose shape is
        not known yet takes its header's receive first; the receives after it from the same
        sender wait for a second batch (after the header is read, once per virtual stage)."""
        waiting = [(msg, sender) for msg, sender in receives]
        ops_, log = [], []
        for msg, to in sends:
            data, dst = self.outbox.pop(msg), self.ranks[to]
            if msg[0] == "act" and msg[2] not in self.announced:
                self.announced[msg[2]] = tuple(data.shape)
                ops_.append(ops.send_op(self._header(data.shape), dst, self.group))
                log.append(("send", to, msg, "header"))
            ops_.append(ops.send_op(data, dst, self.group))
            log.append(("send", to, msg, "data"))
        while ops_ or waiting:
            headers, later, blocked = [], [], set()
            for msg, sender in waiting:
                if sender in blocked:
                    later.append((msg, sender))
                    continue
                if msg[0] == "act" and msg[2] not in self.shapes:
                    buffer = torch.zeros(_MAX_DIMS + 1, dtype=torch.int64, device=self.device)
                    headers.append((msg[2], buffer))
                    part = "header"
                    later.append((msg, sender))
                    blocked.add(sender)
                else:
                    buffer = torch.empty(self._shape_of(msg), dtype=self.dtype,
                                         device=self.device)
                    self.inbox[msg] = buffer
                    part = "data"
                ops_.append(ops.recv_op(buffer, self.ranks[sender], self.group))
                log.append(("recv", sender, msg, part))
            self._post(ops_, log)
            for vs, buffer in headers:
                if vs in self.known:
                    self.shapes[vs] = self.known[vs]
                    continue
                dims = buffer.tolist()  # the one host sync of this virtual stage's messages
                self.shapes[vs] = tuple(dims[1:1 + dims[0]])
            ops_, log, waiting = [], [], later

    def _post(self, p2p: list, log: list) -> None:
        index = sum(1 for kind, _ in self.log if kind == "post")
        works = ops.batch_isend_irecv(p2p)
        self.log += [("post", log), ("wait", index)]
        for work in works:
            work.wait()

    def _shape_of(self, msg: tuple) -> tuple:
        kind, mb, vs = msg
        return self.shapes[vs] if kind == "act" else self.sent_shapes[mb, vs - 1]

    def _header(self, size: torch.Size) -> torch.Tensor:
        if len(size) > _MAX_DIMS:
            raise ValueError(f"a pipeline activation has at most {_MAX_DIMS} dimensions, got "
                             f"shape {tuple(size)}")
        dims = [len(size), *size] + [0] * (_MAX_DIMS - len(size))
        return torch.tensor(dims, dtype=torch.int64, device=self.device)


def rendezvous_deadlock(logs: dict[int, list[tuple]]) -> str | None:
    """Replay every rank's :attr:`Link.log` under NCCL's strictest rule (a send completes only
    when its receive is posted, messages between two ranks match in send order, a batch
    completes when all its operations have): ``None`` when every rank finishes, else what
    each stuck rank waits at."""
    at = {r: 0 for r in logs}
    posted: dict[int, list] = {r: [] for r in logs}  # batch index -> [op] per rank
    sends: dict[tuple, list] = {}  # (sender, receiver) -> messages posted, in order
    recvs: dict[tuple, list] = {}
    progress = True
    while progress:
        progress = False
        for r, log in logs.items():
            while at[r] < len(log):
                kind, what = log[at[r]]
                if kind == "post":
                    posted[r].append(what)
                    for op, peer, msg, part in what:
                        key = (r, peer) if op == "send" else (peer, r)
                        (sends if op == "send" else recvs).setdefault(key, []).append(
                            (msg, part))
                elif not all(_matched(r, op, peer, msg, part, sends, recvs)
                             for op, peer, msg, part in posted[r][what]):
                    break
                at[r] += 1
                progress = True
    stuck = {r: logs[r][at[r]] for r in logs if at[r] < len(logs[r])}
    return None if not stuck else f"ranks stuck at {stuck}"


def _matched(rank, op, peer, msg, part, sends, recvs) -> bool:
    key = (rank, peer) if op == "send" else (peer, rank)
    mine, theirs = (sends, recvs) if op == "send" else (recvs, sends)
    position = mine[key].index((msg, part))
    other = theirs.get(key, [])
    if position < len(other) and other[position] != (msg, part):
        raise AssertionError(f"ranks {key} match {other[position]} with {(msg, part)}")
    return position < len(other)
