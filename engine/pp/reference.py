"""The per-rank orders that ``torch.distributed.pipelining`` generates, as this engine's
schedules: the ground truth the engine's orders are compared with.

A PyTorch schedule computes every rank's order when it is built (``pipeline_order``), from
the stages' sizes alone. Stand-ins that carry only those sizes (``num_stages``,
``group_size``, ``group_rank``, ``submod``) are enough to build one, so no process group,
model or step is needed. PyTorch names the actions by global stage index; here they become
:class:`engine.pp.actions.Action` s on the rank's chunk (``F``; ``I``, its input gradient, as
``B``; ``W``), a full backward ``B`` as ``B`` then ``W`` in a schedule that has W's, and an
``OVERLAP_F_B`` pair (DualPipe runs a forward and a backward together) as its two parts in
order. Empty slots and bookkeeping actions (``REDUCE_GRAD``: where data parallelism would
reduce) are dropped.
"""

from __future__ import annotations

from types import SimpleNamespace

from engine.pp.actions import Action, virtual_stages
from engine.pp.registry import SCHEDULES, schedule_spec

# the registered schedules PyTorch also builds (their ``torch_class``); the interleaved one
# under its generator's name, "interleaved_1f1b"
NAMES = tuple("interleaved_1f1b" if name == "interleaved" else name
              for name, spec in SCHEDULES.items() if spec.torch_class)


def torch_order(name: str, p: int, m: int, v: int = 2) -> dict[int, list[Action]]:
    """The order of PyTorch's schedule ``name`` (one of :data:`NAMES`) for ``p`` ranks and
    ``m`` micro-batches (``v`` chunks per rank for ``interleaved_1f1b``)."""
    from torch.distributed.pipelining import schedules

    if name not in NAMES:
        raise ValueError(f"name must be one of {', '.join(NAMES)}; got {name!r}")
    spec = schedule_spec("interleaved" if name == "interleaved_1f1b" else name)
    cls_name, placement = spec.torch_class, spec.placement
    v = v if spec.takes_chunks else spec.chunks
    stages = [SimpleNamespace(num_stages=p * v, group_size=p, group_rank=0, submod=None,
                              stage_index=i, is_first=i == 0, is_last=i == p * v - 1)
              for i in virtual_stages(0, p, v, placement)]
    built = getattr(schedules, cls_name)(stages, m, loss_fn=lambda output, target: output)
    parts = {rank: [part for action in actions if action is not None
                    for part in action.sub_actions or (action,)]
             for rank, actions in built.pipeline_order.items()}
    split = any(part.computation_type.value in ("I", "W") for acts in parts.values()
                for part in acts)
    return {rank: _as_actions(acts, rank, p, v, placement, split)
            for rank, acts in parts.items()}


def _as_actions(parts, rank: int, p: int, v: int, placement: str, split: bool
                ) -> list[Action]:
    chunk_of = {vs: c for c, vs in enumerate(virtual_stages(rank, p, v, placement))}
    out: list[Action] = []
    for part in parts:
        kind = part.computation_type.value
        if kind not in ("F", "I", "B", "W"):  # REDUCE_GRAD and the like: not compute
            continue
        chunk = chunk_of[part.stage_index]
        out.append(Action("F" if kind == "F" else "W" if kind == "W" else "B",
                          part.microbatch_index, chunk))
        if kind == "B" and split:  # a full backward among split ones: B and W at once
            out.append(Action("W", part.microbatch_index, chunk))
    return out
