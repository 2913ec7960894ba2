"""What :class:`engine.zero.stage3.ZeroDataParallel` needs beside its algorithm: cutting the
model into units, prefetching, the log of what is gathered, autocast, and what a rank holds.

The kernel (:mod:`engine.zero.stage3`) gathers a unit before it runs and frees it after; these
are the strategies it calls at those points, each replaceable on its own:

* :func:`make_units`: one unit per module that owns parameters (or the modules given, e.g.
  the transformer blocks); parameters two units share (tied embeddings) or no unit holds form
  the *root* unit, whole for the whole step (Rajbhandari et al., ZeRO, SC 2020, section 5.3).
* :class:`Prefetch`: PyTorch FSDP's ``forward_prefetch`` (start the next unit's gather before
  the current unit's forward; off by default, as there) and ``BackwardPrefetch.BACKWARD_PRE``
  (start the gather of the unit whose backward comes next; on by default, as there), in the
  order the last forward ran the units. Each lets two units be whole at once.
* :class:`GatherLog`: the bytes gathered now, at most (``peak``) and each gather and free in
  time (``timeline``), what chapter 4 plots.
* :class:`Autocast`: under bf16 autocast, the casts of a unit's weights are not kept from
  forward to backward (:mod:`engine.zero.recast`): backward casts again from the re-gathered
  unit, so what is held between the two passes is what fp32 holds.
* :class:`Measured`, :func:`state_tensors`: the bytes gathered now and at most, what a rank
  holds (:mod:`engine.observe.memory`).
* :class:`ShardOptimizer`: ``model.optimizer``, the inner optimizer stepping the shards;
  :func:`check_optimizer_kwargs` and :func:`broadcast_from_first`, the wrapper's set-up.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

from engine.comm import ops
from engine.observe.memory import (StateBytes, StateTensors, count_state_bytes,
                                   optimizer_tensors)
from engine.zero.recast import drop_autocast_cache, recast_in_backward


def check_optimizer_kwargs(kwargs: dict) -> None:
    """A ``prefetch=`` among the optimizer's arguments is a mix-up with PyTorch FSDP's names
    (else the optimizer would say only "unexpected keyword")."""
    if "prefetch" in kwargs:
        raise TypeError("ZeroDataParallel takes forward_prefetch= and backward_prefetch= "
                        f"(PyTorch FSDP's names), not prefetch={kwargs['prefetch']!r}")


def broadcast_from_first(module: nn.Module, group) -> None:
    """Every rank of ``group`` starts from its first rank's parameters."""
    with torch.no_grad():
        for p in module.parameters():
            ops.broadcast(p.data, ops.group_ranks(group)[0], group)


def make_units(module: nn.Module, units=None):
    """``(root params, [(module, name, params)])``: each unit's own parameters (claimed by it
    alone), in the order given; the root's: every trainable parameter no unit claims alone."""
    if units is None:
        units = [m for m in module.modules() if any(True for _ in m.parameters(False))]
    units = list(units)
    claimed: dict[nn.Parameter, int] = {}
    for i, mod in enumerate(units):
        for p in mod.parameters():
            if p.requires_grad:
                claimed[p] = i if p not in claimed else -1  # two units: the root's
    made = []
    for i, mod in enumerate(units):
        mine = list(dict.fromkeys(p for p in mod.parameters() if claimed.get(p) == i))
        if mine:
            made.append((mod, type(mod).__name__, mine))
    root = [p for p in dict.fromkeys(module.parameters())
            if p.requires_grad and claimed.get(p, -1) == -1]
    return root, made


class Prefetch:
    """Which gather to start early (module docstring); ``start(unit, event)`` starts one."""

    def __init__(self, units: list, start, forward: bool, backward: bool):
        self.units, self.start = units, start
        self.forward, self.backward = forward, backward
        self.order: list = []  # units in the order the last forward ran them

    def forward_started(self) -> None:
        self.order = []

    def before_forward(self, unit) -> None:
        if self.backward:  # the only reader of the order
            self.order.append(unit)
        following = _next_in(self.units, unit) if self.forward else None
        if following is not None:  # its gather overlaps with this unit's compute
            self.start(following, "forward prefetch")

    def before_backward(self, unit) -> None:
        earlier = _next_in(self.order[::-1], unit) if self.backward else None
        if earlier is not None and not earlier.ready:  # backward runs the units in reverse
            self.start(earlier, "backward prefetch")


def _next_in(order: list, unit):
    i = order.index(unit) if unit in order else -1
    return order[i + 1] if 0 <= i < len(order) - 1 else None


class GatherLog:
    """Bytes of whole units held now (``bytes``), at most (``peak``), and each change in time
    (``timeline``: ``(time, bytes, event)``)."""

    def __init__(self):
        self.bytes = self.peak = 0
        self.timeline: list[tuple[float, int, str]] = []

    def add(self, delta: int, event: str) -> None:
        self.bytes += delta
        self.peak = max(self.peak, self.bytes)
        self.timeline.append((time.perf_counter(), self.bytes, event))


class Autocast:
    """Autocast's casts of a unit's weights, cast again in backward rather than kept."""

    def __init__(self, params, device_type: str):
        self.params, self.device_type = params, device_type

    def around_forward(self) -> contextlib.AbstractContextManager:
        return recast_in_backward(self.params)

    def after_unit(self) -> None:
        drop_autocast_cache(self.device_type)  # autocast's casts of the unit go with it


def output_tensors(output) -> list[torch.Tensor]:
    """Every tensor of a (nested tuple, list or dict) module output."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in output_tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in output_tensors(o)]
    return []


class Measured:
    """What a :class:`engine.zero.stage3.ZeroDataParallel` reports: the bytes of whole units
    held now and at most, and when (its :class:`GatherLog`), and what a rank holds
    (:mod:`engine.observe.memory`, each storage counted once)."""

    gathered_bytes = property(lambda self: self.log.bytes)
    peak_gathered_bytes = property(lambda self: self.log.peak)
    memory_timeline = property(lambda self: self.log.timeline)

    def state_tensors(self) -> StateTensors:
        return state_tensors(self)

    def state_bytes(self) -> StateBytes:
        return count_state_bytes(self.state_tensors())


def state_tensors(model) -> StateTensors:
    """What a rank of ``model`` (a ZeroDataParallel) holds: shards of parameters and
    gradients, any unit still gathered, the optimizer state and the fp32 masters (where the
    shards are not fp32 themselves)."""
    units = model.all_units
    params = [u.shard for u in units] + [u.full for u in units if u.full is not None]
    optim = optimizer_tensors(model.optimizer.inner) + \
        [u.master for u in units if u.master.dtype != u.shard.dtype]
    return StateTensors(params=params, grads=[u.shard_grad for u in units], optimizer=optim)


class ShardOptimizer:
    """``model.optimizer``: steps the inner optimizer on the shards, with their gradients."""

    def __init__(self, model, inner: torch.optim.Optimizer):
        self.model, self.inner = model, inner

    @torch.no_grad()
    def step(self) -> None:
        for unit in self.model.all_units:
            unit.master.grad = unit.shard_grad.float()
        self.inner.step()
        for unit in self.model.all_units:
            unit.master.grad = None
            if unit.master.dtype != unit.shard.dtype:
                unit.shard.copy_(unit.master)  # fp32 master -> the precision we gather in

    def zero_grad(self, set_to_none: bool = True) -> None:
        for unit in self.model.all_units:
            unit.shard_grad.zero_()

    param_groups = property(lambda self: self.inner.param_groups)

    def state_tensors(self) -> StateTensors:
        return self.model.state_tensors()  # the optimizer state lives with its shards
