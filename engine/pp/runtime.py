"""Run a pipeline schedule on real ranks: its actions, in its order, and nothing else.

Rank ``s`` holds model chunks ``c = 0..v-1`` of a model cut into ``p*v`` consecutive pieces;
chunk ``c`` is virtual stage :func:`engine.pp.actions.virtual_stage` ``(s, c, p, placement)``
(``c*p + s`` when interleaved, Megatron-LM, Narayanan et al., SC 2021). For each action, in
the schedule's order (GPipe, Huang et al. 2019; 1F1B, PipeDream-Flush, Narayanan et al. 2021;
or a zero-bubble one):

* ``F(mb, c)``: take micro-batch ``mb``'s input (virtual stage 0) or receive the activation
  from the previous virtual stage; run the chunk; send the output on, or, on the last
  virtual stage, compute ``loss / m``.
* ``B(mb, c)``: backward from the loss, or from the gradient received from the next virtual
  stage; send the input's gradient back. In a schedule with W actions this is the input
  gradient only (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): the linear
  layers' weight gradients wait, with the inputs and output gradients they need
  (:mod:`engine.pp.weight_grad`), and the rest of the graph is freed.
* ``W(mb, c)``: those weight gradients, ``dW = dYᵀ X``, by ``weight_grads`` (a hook: a
  sharded wrapper passes its own, whose late gradients it then reduces).

Gradients accumulate across micro-batches in ``param.grad``; scaling each loss by ``1/m``
makes the sum the full batch's mean gradient. The schedule comes checked and planned once per
run (:class:`engine.pp.registry.PipelineSchedule`); the messages go through
:class:`engine.pp.link.Link` (batches that cannot deadlock on NCCL, no host sync per
message); what the run is seen doing (its timeline, the bytes it holds, its waits for
messages) is told to an observer (:class:`engine.pp.observers.Recorder` by default).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from engine.comm import ops
from engine.pp.actions import rank_of, virtual_stages
from engine.pp.link import Link
from engine.pp.observers import PipelineRun, Recorder
from engine.pp.registry import PipelineSchedule
from engine.pp.weight_grad import apply_weight_grads, deferred_weight_grads


def run_pipeline(chunks: list[nn.Module], schedule, inputs: list[torch.Tensor],
                 targets: list[torch.Tensor], loss_fn=nn.functional.mse_loss, *,
                 stage: int | None = None, group=None, placement: str | None = None,
                 weight_grads=apply_weight_grads, observer=None,
                 shapes: dict[int, tuple] | None = None) -> PipelineRun:
    """Execute pipeline stage ``stage``'s part of ``schedule`` (one forward and backward over
    ``m`` micro-batches). ``schedule``: a :class:`engine.pp.registry.PipelineSchedule`
    (:func:`engine.pp.build_schedule`, which carries its placement), or a plain ``{stage:
    [actions]}`` with its ``placement`` (default ``"interleaved"``), checked here. ``stage`` is this rank's position in the pipeline ``group``
    (its ``mesh.coords.pp``); ``chunks[c]`` is the virtual stage
    ``virtual_stages(stage, p, v, placement)[c]``; ``inputs``/``targets`` are the
    micro-batches (used on the first and last virtual stage). Gradients land in the chunks'
    ``param.grad`` (call ``zero_grad`` between steps). ``weight_grads(stash)`` runs each W
    action (default :func:`engine.pp.weight_grad.apply_weight_grads`); ``observer`` sees the
    run (default :class:`engine.pp.observers.Recorder`) and makes what is returned.
    ``shapes``: every virtual stage's activation shape, known in advance (a dry run on the
    meta device: its shape headers travel, as a real run's do, but carry no values)."""
    if stage is None or isinstance(chunks, int):
        raise TypeError("run_pipeline needs stage=, this rank's position in the pipeline "
                        "group: run_pipeline(chunks, schedule, inputs, targets, loss_fn, "
                        "stage=..., group=...)")
    if not isinstance(schedule, PipelineSchedule):  # a schedule that would deadlock: an error
        schedule = PipelineSchedule(schedule, placement or "interleaved")
    elif placement not in (None, schedule.placement):
        raise ValueError(f"placement={placement!r}, but the built schedule "
                         f"{schedule.name!r} places its chunks {schedule.placement!r}")
    p, m, v, placement = schedule.p, schedule.m, schedule.v, schedule.placement
    ranks = _pipeline_ranks(stage, p, group)
    if len(chunks) != v:
        raise ValueError(f"the schedule has {v} chunk(s) per rank, got {len(chunks)} modules")
    if len(inputs) != m or len(targets) != m:
        raise ValueError(f"the schedule has m={m} micro-batches, got {len(inputs)} inputs and "
                         f"{len(targets)} targets")
    mine, last = virtual_stages(stage, p, v, placement), p * v - 1
    first_param = next(chunks[0].parameters())
    link = Link(schedule, stage, ranks, group, first_param.dtype, first_param.device)
    link.known = shapes or {}
    watch = Recorder(stage, chunks) if observer is None else observer
    stored, waiting = {}, {}  # (mb, chunk) -> what B needs; -> what W needs
    total_loss = 0.0  # a tensor once the last stage adds its first loss

    for kind, mb, c in watch.actions(link):  # each after the batch that brings its input
        vs = mine[c]
        if kind == "F":
            if vs == 0:  # its own copy: a view would pin (and count) the whole batch
                x = inputs[mb].detach().clone()
            else:
                x = link.receive(("act", mb, vs - 1), rank_of(vs - 1, p, placement))
                x.requires_grad_()
            defer = deferred_weight_grads(chunks[c].parameters()) if schedule.split \
                else nullcontext()
            with watch.forward(mb, c), defer as stash:
                out = chunks[c](x)
                if vs == last:
                    out = loss_fn(out, targets[mb].detach().clone()) / m
            stored[mb, c] = (x, out, stash)
            if vs == last:  # summed on the device: one host sync, at the end
                total_loss = total_loss + out.detach().double()
            else:
                link.send(out, ("act", mb, vs), rank_of(vs + 1, p, placement))
        elif kind == "B":
            x, out, stash = stored.pop((mb, c))
            grad = None if vs == last else \
                link.receive(("grad", mb, vs + 1), rank_of(vs + 1, p, placement))
            with watch.backward(mb, c, stash):
                out.backward(grad)
            if schedule.split:  # what W needs stays: each linear layer's input and output grad
                waiting[mb, c] = stash
            if vs != 0:
                link.send(x.grad, ("grad", mb, vs), rank_of(vs - 1, p, placement))
        else:
            with watch.weight_grad(mb, c):
                weight_grads(waiting.pop((mb, c)))
    loss = None
    if schedule.loss_stage == stage:  # a dry run's loss (meta device) has no value: nan
        loss = float("nan") if getattr(total_loss, "is_meta", False) else float(total_loss)
    return watch.result(loss, link.log)


def _pipeline_ranks(stage, p: int, group) -> tuple[int, ...]:
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
