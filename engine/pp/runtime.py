"""Run any pipeline schedule (:mod:`engine.pp.schedules`) on real ranks.

Rank ``s`` holds model chunks ``c = 0..v-1`` of a model cut into ``p*v`` consecutive pieces;
chunk ``c`` is virtual stage :func:`engine.pp.actions.virtual_stage` ``(s, c, p, placement)``
(``c*p + s`` when interleaved). For each action, in the schedule's order:

* ``F(mb, c)``: take micro-batch ``mb``'s input (virtual stage 0) or receive the activation
  from the previous virtual stage; run the chunk; send the output on, or, on the last
  virtual stage, compute ``loss / m``. What autograd keeps for backward is counted.
* ``B(mb, c)``: backward from the loss, or from the gradient received from the next virtual
  stage; send the input's gradient back. In a schedule with W actions this is the input
  gradient only: the linear layers' weight gradients wait, with the inputs and output
  gradients they need (:mod:`engine.pp.weight_grad`), and the rest of the graph is freed.
* ``W(mb, c)``: those weight gradients, ``dW = dYᵀ X``.

Messages go through :class:`engine.pp.link.Link`: batches of sends and receives planned in
rounds that match across ranks (no deadlock on NCCL), no tags (received in the order they were
sent, as NCCL needs), no host sync per message; what the rank holds is counted by
:class:`engine.pp.stage_memory.StageMemory`, fed once per action. Gradients accumulate across
micro-batches in ``param.grad``; scaling each loss by ``1/m`` makes the sum the full batch's
mean gradient.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.comm import ops
from engine.observe.memory import ActivationTracker
from engine.pp.actions import actions_of, rank_of, shape, splits_backward, virtual_stages
from engine.pp.link import Link
from engine.pp.schedules import validate
from engine.pp.stage_memory import StageMemory
from engine.pp.weight_grad import apply_weight_grads, deferred_weight_grads
from engine.observe.trace import Clock, TraceEvent


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
    (compute timeline), ``peak_activation_bytes``: the most bytes held at once for backward
    (activations until B; in a schedule with W, then the inputs and output gradients W needs),
    ``activation_bytes`` of one micro-batch's forward per chunk, ``peak_in_flight`` micro-batch
    chunks between F and B; with W also ``weight_stash_bytes`` (per chunk, what one micro-batch
    holds between B and W), ``peak_grad_stash_bytes`` (the most output-gradient bytes held for
    W at once) and ``peak_held`` (micro-batch chunks between F and W). ``p2p_log``: the
    point-to-point batches posted and waited on (:attr:`engine.pp.link.Link.log`).
    ``p2p_events``: the spans this rank spent in those batches (posting and waiting, lane
    ``p2p``), kept apart from ``events`` so the idle share still counts them as idle."""

    loss: float | None
    events: list[TraceEvent] = field(default_factory=list)
    peak_activation_bytes: int = 0
    activation_bytes: dict[int, int] = field(default_factory=dict)
    peak_in_flight: int = 0
    weight_stash_bytes: dict[int, int] = field(default_factory=dict)
    peak_grad_stash_bytes: int = 0
    peak_held: int = 0
    p2p_log: list = field(default_factory=list)
    p2p_events: list[TraceEvent] = field(default_factory=list)


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
                 stage: int | None = None, group=None,
                 placement: str = "interleaved", weight_grads=apply_weight_grads
                 ) -> PipelineRun:
    """Execute pipeline stage ``stage``'s part of ``schedule`` (one forward and backward over
    ``m`` micro-batches). ``stage`` is this rank's position in the pipeline ``group`` (its
    ``mesh.coords.pp``); ``chunks[c]`` is the virtual stage
    ``virtual_stages(stage, p, v, placement)[c]``; ``inputs``/``targets`` are the
    micro-batches (used on the first and last virtual stage). Gradients land in the chunks'
    ``param.grad`` (call ``zero_grad`` between steps). ``weight_grads(stash)`` runs each W
    action (default :func:`engine.pp.weight_grad.apply_weight_grads`; a sharded wrapper
    passes its own, e.g. ZeRO-3 reduce-scattering the unit's gradients after its W)."""
    if stage is None or isinstance(chunks, int):
        raise TypeError("run_pipeline needs stage=, this rank's position in the pipeline "
                        "group: run_pipeline(chunks, schedule, inputs, targets, loss_fn, "
                        "stage=..., group=...)")
    validate(schedule, placement=placement)  # a schedule that would deadlock: an error here
    schedule = actions_of(schedule)
    p, m, v = shape(schedule)
    ranks = _check_stage(stage, p, group)
    if len(chunks) != v:
        raise ValueError(f"the schedule has {v} chunk(s) per rank, got {len(chunks)} modules")
    if len(inputs) != m or len(targets) != m:
        raise ValueError(f"the schedule has m={m} micro-batches, got {len(inputs)} inputs and "
                         f"{len(targets)} targets")
    split = splits_backward(schedule)
    mine = virtual_stages(stage, p, v, placement)
    last = p * v - 1
    first_param = next(chunks[0].parameters())
    link = Link(schedule, stage, ranks, group, placement, first_param.dtype,
                first_param.device)
    clock = Clock(first_param.device)  # CUDA events on a GPU: execution, not launch, times
    params = [q for c in chunks for q in c.parameters()]
    stored, waiting, marks, rounds = {}, {}, [], []
    memory = StageMemory()
    total_loss = 0.0  # a tensor once the last stage adds its first loss

    for kind, mb, c in _timed(link, clock, rounds):  # each after its input came
        vs = mine[c]
        if kind == "F":
            if vs == 0:  # its own copy: a view would pin (and count) the whole batch
                x = inputs[mb].detach().clone()
            else:
                x = link.receive(("act", mb, vs - 1), rank_of(vs - 1, p, placement))
                x.requires_grad_()
            defer = deferred_weight_grads(chunks[c].parameters()) if split else nullcontext()
            start = clock.mark()
            with ActivationTracker(exclude=params) as acts, defer as stash:
                out = chunks[c](x)
                if vs == last:
                    out = loss_fn(out, targets[mb].detach().clone()) / m
            end = clock.mark()
            stored[mb, c] = (x, out, stash)
            memory.forward(mb, c, acts.bytes)
            if vs == last:  # summed on the device: one host sync, at the end
                total_loss = total_loss + out.detach().double()
            else:
                link.send(out, ("act", mb, vs), rank_of(vs + 1, p, placement))
        elif kind == "B":
            x, out, stash = stored.pop((mb, c))
            grad = None if vs == last else \
                link.receive(("grad", mb, vs + 1), rank_of(vs + 1, p, placement))
            start = clock.mark()
            out.backward(grad)
            end = clock.mark()
            if split:  # what W needs stays: each linear layer's input and output gradient
                waiting[mb, c] = stash
            memory.backward(mb, c, stash)
            if vs != 0:
                link.send(x.grad, ("grad", mb, vs), rank_of(vs - 1, p, placement))
        else:
            start = clock.mark()
            weight_grads(waiting.pop((mb, c)))
            end = clock.mark()
            memory.weight_grad(mb, c)
        marks.append((kind, mb, c, start, end))
    events = [TraceEvent(f"{kind}{mb}", stage, clock.seconds(start), clock.seconds(end),
                         lane="compute", args={"kind": kind, "mb": mb, "chunk": c})
              for kind, mb, c, start, end in marks]
    p2p = [TraceEvent("p2p", stage, clock.seconds(start), clock.seconds(end), lane="p2p")
           for start, end in rounds]
    holds_last = rank_of(last, p, placement) == stage
    loss = float(total_loss) if holds_last else None
    return PipelineRun(loss, events, p2p_log=link.log, p2p_events=p2p, **memory.counts())


def _timed(link: Link, clock, rounds: list):
    """``link.actions()``; each span spent getting the next action in which a batch of sends
    and receives was posted and waited on is appended to ``rounds`` as two clock marks."""
    iterator = link.actions()
    while True:
        start, logged = clock.mark(), len(link.log)
        item = next(iterator, None)
        if len(link.log) != logged:
            rounds.append((start, clock.mark()))
        if item is None:
            return
        yield item


def measured_idle(events: list[TraceEvent]) -> dict[int, float]:
    """Idle share of each stage between the run's first start and last end (shared clock)."""
    start = min(e.start for e in events)
    span = max(e.end for e in events) - start
    busy: dict[int, float] = {}
    for e in events:
        busy[e.rank] = busy.get(e.rank, 0.0) + e.end - e.start
    return {stage: 1 - b / span for stage, b in sorted(busy.items())}


def stage_times(events: list[TraceEvent], chunks: int = 1) -> dict[str, list[float]]:
    """Median seconds of each kind of action (``F``, ``B``, ``W``) per stage, times
    ``chunks`` (so they are a whole stage's, as :func:`engine.pp.simulate` takes them)."""
    import statistics

    stages = sorted({e.rank for e in events})
    out: dict[str, list[float]] = {}
    for kind in "FBW":
        per_stage = [[e.end - e.start for e in events if e.rank == s and e.args["kind"] == kind]
                     for s in stages]
        if all(per_stage):
            out[kind] = [statistics.median(t) * chunks for t in per_stage]
    return out


def measured_bubble(events: list[TraceEvent], p: int) -> float:
    """Idle share of ``p`` ranks over the run, from their compute events (shared clock)."""
    start = min(e.start for e in events)
    end = max(e.end for e in events)
    busy = sum(e.end - e.start for e in events)
    return 1 - busy / (p * (end - start))
