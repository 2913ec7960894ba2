"""Run any pipeline schedule (:mod:`engine.pp.schedules`) on real ranks.

Rank ``s`` holds model chunks ``c = 0..v-1``, chunk ``c`` being virtual stage ``c*p + s`` of
a model cut into ``p*v`` consecutive pieces. For each action, in the schedule's order:

* ``F(mb, c)``: take micro-batch ``mb``'s input (virtual stage 0) or receive the activation
  from the previous virtual stage; run the chunk; send the output on, or, on the last
  virtual stage, compute ``loss / m``. What autograd keeps for backward is counted.
* ``B(mb, c)``: backward from the loss, or from the gradient received from the next virtual
  stage; send the input's gradient back.

Receives block; sends are posted (``isend``) and completed at the end, so no schedule that
:func:`engine.pp.validate` accepts can deadlock. A tensor travels as a small shape message and
then its data, both tagged by (micro-batch, virtual stage, direction): any shapes work, and
messages between the same two ranks never mix. Gradients accumulate across micro-batches in
``param.grad``; scaling each loss by ``1/m`` makes the sum the full batch's mean gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine.comm import ops
from engine.memory import ActivationTracker
from engine.pp.schedules import _shape, actions_of, validate
from engine.trace import Clock, TraceEvent

_MAX_DIMS = 8


def uniform_boundaries(n_layers: int, parts: int) -> list[int]:
    """First layer index of each of ``parts`` near-equal consecutive pieces."""
    if parts > n_layers:
        raise ValueError(f"cannot cut {n_layers} layers into {parts} pipeline stages: each "
                         "stage needs at least one layer")
    q, r = divmod(n_layers, parts)
    starts, at = [], 0
    for i in range(parts):
        starts.append(at)
        at += q + (1 if i < r else 0)
    return starts


def balanced_boundaries(layer_times: list[float], parts: int) -> list[int]:
    """Cut layers with measured ``layer_times`` into ``parts`` consecutive pieces so that the
    slowest piece is as fast as possible (linear partitioning by dynamic programming; the
    pipeline runs at the pace of its slowest stage)."""
    n = len(layer_times)
    if parts > n:
        raise ValueError(f"cannot cut {n} layers into {parts} pipeline stages: each stage "
                         "needs at least one layer")
    prefix = [0.0]
    for t in layer_times:
        prefix.append(prefix[-1] + t)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]  # best[k][i]: first i layers, k parts
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    starts, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def split_model(layers: nn.Sequential, starts: list[int]) -> list[nn.Sequential]:
    """The pieces of ``layers`` beginning at ``starts`` (from :func:`uniform_boundaries`)."""
    n = len(layers)
    if not starts or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) \
            or starts[-1] >= n:
        raise ValueError(f"stage boundaries must start at 0, increase strictly and stay below "
                         f"the {n} layers; got {starts}")
    ends = starts[1:] + [n]
    return [nn.Sequential(*[layers[i] for i in range(a, b)]) for a, b in zip(starts, ends)]


@dataclass
class PipelineRun:
    """What one rank saw: ``loss`` (the last stage's mean loss, else None), ``events``
    (compute timeline), ``peak_activation_bytes`` held at once, ``activation_bytes`` of one
    micro-batch's forward per chunk, and ``peak_in_flight`` micro-batch chunks."""

    loss: float | None
    events: list[TraceEvent] = field(default_factory=list)
    peak_activation_bytes: int = 0
    activation_bytes: dict[int, int] = field(default_factory=dict)
    peak_in_flight: int = 0


def _tag(kind: str, mb: int, vs: int, stages: int) -> int:
    return 4 * (mb * stages + vs) + (0 if kind == "act" else 2)


def _send(tensor, dst, tag, group, pending):
    shape = torch.zeros(_MAX_DIMS + 1, dtype=torch.int64, device=tensor.device)
    shape[0] = tensor.dim()
    shape[1:1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64,
                                             device=tensor.device)
    data = tensor.detach().contiguous()
    pending += [(ops.isend(shape, dst, group, tag), shape),
                (ops.isend(data, dst, group, tag + 1), data)]


def _recv(src, tag, group, dtype, device):
    shape = torch.empty(_MAX_DIMS + 1, dtype=torch.int64, device=device)
    ops.recv(shape, src, group, tag)
    out = torch.empty(tuple(shape[1:1 + int(shape[0])].tolist()), dtype=dtype, device=device)
    ops.recv(out, src, group, tag + 1)
    return out


def _check_stage(stage, p: int, group) -> tuple[int, ...]:
    """The pipeline group's ranks, once ``stage`` is known to be this process's place in it."""
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < p:
        raise ValueError(f"stage={stage!r} is not a stage of this {p}-stage schedule (expected "
                         f"0..{p - 1}): pass this rank's position in the pipeline group (for "
                         "example mesh.coords.pp), not its global rank")
    ranks = ops.group_ranks(group)
    if len(ranks) != p:
        raise ValueError(f"the schedule has p={p} stages but the pipeline group has "
                         f"{len(ranks)} ranks {list(ranks)}")
    me = torch.distributed.get_rank()
    if me not in ranks or ranks.index(me) != stage:
        actual = f"stage {ranks.index(me)}" if me in ranks else "not a member"
        raise ValueError(f"stage={stage}, but this process (global rank {me}) is {actual} of "
                         f"the pipeline group {list(ranks)}")
    return ranks


def run_pipeline(chunks: list[nn.Module], schedule, inputs: list[torch.Tensor],
                 targets: list[torch.Tensor], loss_fn=nn.functional.mse_loss, *,
                 stage: int | None = None, group=None) -> PipelineRun:
    """Execute pipeline stage ``stage``'s part of ``schedule`` (one forward and backward over
    ``m`` micro-batches). ``stage`` is this rank's position in the pipeline ``group`` (its
    ``mesh.coords.pp``); ``chunks[c]`` is virtual stage ``c*p + stage``; ``inputs``/``targets``
    are the micro-batches (used on the first and last virtual stage). Gradients land in the
    chunks' ``param.grad`` (call ``zero_grad`` between steps)."""
    if stage is None or isinstance(chunks, int):
        raise TypeError("run_pipeline needs stage=, this rank's position in the pipeline "
                        "group: run_pipeline(chunks, schedule, inputs, targets, loss_fn, "
                        "stage=..., group=...)")
    validate(schedule)  # a schedule that would deadlock is an error here, not a hang
    schedule = actions_of(schedule)
    p, m, v = _shape(schedule)
    ranks = _check_stage(stage, p, group)
    if len(chunks) != v:
        raise ValueError(f"the schedule has {v} chunk(s) per rank, got {len(chunks)} modules")
    if len(inputs) != m or len(targets) != m:
        raise ValueError(f"the schedule has m={m} micro-batches, got {len(inputs)} inputs and "
                         f"{len(targets)} targets")
    stages = p * v
    last = stages - 1
    stored, pending, events = {}, [], []
    held = peak = in_flight = peak_flight = 0
    per_chunk: dict[int, int] = {}
    total_loss = 0.0
    first_param = next(chunks[0].parameters())
    dtype, device = first_param.dtype, first_param.device
    clock = Clock(device)  # CUDA events on a GPU: the timeline shows execution, not launch
    marks = []
    params = [q for c in chunks for q in c.parameters()]
    here: dict[int, torch.Tensor] = {}  # p = 1: neighbouring chunks share this rank

    def send(tensor, to_vs, tag):
        if p == 1:  # a copy, detached, as a receiver would get; Gloo cannot send to itself
            here[tag] = tensor.detach().clone()
        else:
            _send(tensor, ranks[to_vs % p], tag, group, pending)

    def recv(from_vs, tag):
        if p == 1:
            return here.pop(tag)
        return _recv(ranks[from_vs % p], tag, group, dtype, device)

    for kind, mb, c in schedule[stage]:
        vs = c * p + stage
        if kind == "F":
            if vs == 0:  # its own copy: a view would pin (and count) the whole batch
                x = inputs[mb].detach().clone()
            else:
                x = recv(vs - 1, _tag("act", mb, vs - 1, stages))
                x.requires_grad_()
            start = clock.mark()
            with ActivationTracker(exclude=params) as acts:
                out = chunks[c](x)
                if vs == last:
                    out = loss_fn(out, targets[mb].detach().clone()) / m
            end = clock.mark()
            stored[mb, c] = (x, out, acts.bytes)
            per_chunk.setdefault(c, acts.bytes)
            held += acts.bytes
            in_flight += 1
            peak, peak_flight = max(peak, held), max(peak_flight, in_flight)
            if vs == last:
                total_loss += out.item()
            else:
                send(out, vs + 1, _tag("act", mb, vs, stages))
        else:
            x, out, nbytes = stored.pop((mb, c))
            grad = None if vs == last else recv(vs + 1, _tag("grad", mb, vs + 1, stages))
            start = clock.mark()
            out.backward(grad)
            end = clock.mark()
            held -= nbytes
            in_flight -= 1
            if vs != 0:
                send(x.grad, vs - 1, _tag("grad", mb, vs, stages))
        marks.append((kind, mb, c, start, end))
    for work, _ in pending:
        work.wait()
    for kind, mb, c, start, end in marks:
        events.append(TraceEvent(f"{kind}{mb}", stage, clock.seconds(start), clock.seconds(end),
                                 lane="compute", args={"kind": kind, "mb": mb, "chunk": c}))
    return PipelineRun(total_loss if last % p == stage else None, events, peak, per_chunk,
                       peak_flight)


def measured_bubble(events: list[TraceEvent], p: int) -> float:
    """Idle share of ``p`` ranks over the run, from their compute events (shared clock)."""
    start = min(e.start for e in events)
    end = max(e.end for e in events)
    busy = sum(e.end - e.start for e in events)
    return 1 - busy / (p * (end - start))
