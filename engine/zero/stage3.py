"""ZeRO stage 3 (P_os+g+p): the parameters are sharded too, so the model must be wrapped.

Rajbhandari et al., ZeRO (SC 2020), section 5.3; PyTorch FSDP's ``FULL_SHARD`` does the same.
The model is cut into *units* (by default every module that owns parameters directly; or the
modules you pass, e.g. the transformer blocks). Each unit's parameters are one flat, padded
bucket, and a rank keeps only its 1/N slice of it. Then, per step:

* **forward**: just before a unit runs, its parameters are all-gathered; just after, freed;
* **backward**: just before the unit's backward (a hook on its output's gradient), gathered
  again; once all its gradients are in, they are reduce-scattered (each rank keeps the
  average of its slice) and the full parameters and gradients are freed;
* **step**: the optimizer updates the shard; nothing else moves.

Two all-gathers and one reduce-scatter: ``3(N-1)/N * psi`` elements per rank per step, 1.5x
data parallelism (the paper's section 7). Prefetching starts the next unit's gather before the
current unit runs, so it overlaps with compute, at the price of holding two units at once.
Like PyTorch's FSDP, the engine prefetches in backward by default (FSDP's
``BackwardPrefetch.BACKWARD_PRE``) and not in forward (FSDP's ``forward_prefetch=False``).

Parameters that are not in any unit, or that two units share (tied embeddings), form the
*root* unit: gathered when the forward starts and freed when the backward ends.

In a zero-bubble pipeline (Qi et al. 2024) B gives a linear layer's input gradient only and
W its weight gradient later, outside autograd: those units wait for W
(:class:`engine.zero.late.LateGradients`); B frees them as soon as it has used their weights,
W adds ``dW = dY^T X`` to their buffers (no gather: W needs no weight), and each W
reduce-scatters the units it filled.

Under bf16 autocast the bf16 casts of a unit's weights are not kept from forward to backward
(:mod:`engine.zero.recast`): backward casts again from the re-gathered unit, so what is
held between the two passes is what fp32 holds.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn

from engine.comm import ops
from engine.dp.buckets import NOTHING_LAUNCHED, BucketLauncher
from engine.observe.memory import (StateBytes, StateTensors, count_state_bytes, mark_held_by,
                           optimizer_tensors)
from engine.validation import boolean
from engine.zero.flat import ShardedBucket, check_params
from engine.zero.late import LateGradients
from engine.zero.recast import drop_autocast_cache, recast_in_backward

_EMPTY = torch.empty(0)


class _Unit(ShardedBucket):
    """One unit: its parameters as a flat sharded bucket, gathered only while needed."""

    def __init__(self, name: str, params: list[nn.Parameter], rank: int, n: int, index: int):
        super().__init__(params, rank, n, index)
        self.name = name
        # pack the current values, keep 1/N, in the model's precision (what is gathered)
        self.shard = self.shard_of(self.flatten(lambda p: p.detach())).clone()
        # what the optimizer updates: the shard itself (fp32), or an fp32 master copy of it
        self.master = nn.Parameter(self.shard if self.shard.dtype == torch.float32
                                   else self.shard.float())
        self.shard_grad = torch.zeros_like(self.shard)
        self.full: torch.Tensor | None = None
        self.pending = None  # an async gather in flight (prefetch)
        self.free()

    @property
    def full_bytes(self) -> int:
        return self.padded * self.shard.element_size()

    def start_gather(self, group) -> None:
        if self.full is None and self.pending is None:
            buffer = torch.empty(self.padded, dtype=self.shard.dtype, device=self.shard.device)
            work = ops.all_gather_into_tensor(buffer, self.shard.detach(), group=group,
                                              async_op=True)
            self.pending = (buffer, work)

    def finish_gather(self) -> None:
        if self.full is None:
            buffer, work = self.pending
            work.wait()
            self.full, self.pending = buffer, None
            for p in self.params:
                p.data = self.view_of(p, self.full)

    def free(self) -> None:
        self.full = None
        for p in self.params:
            p.data = _EMPTY.to(dtype=p.dtype, device=p.device)


class ZeroDataParallel(LateGradients, nn.Module):
    """ZeRO stage 3: ``model = ZeroDataParallel(module, torch.optim.AdamW, lr=1e-3)``; then
    ``loss = model(x)...; loss.backward(); model.optimizer.step(); model.optimizer.zero_grad()``.

    Args:
        module: the model; its parameters are broadcast from the group's first rank, then
            sharded (each rank keeps 1/N of every unit).
        optimizer_cls, **kwargs: the optimizer, run on this rank's shards only.
        units: the modules to gather and free one at a time (default: every module that owns
            parameters directly).
        forward_prefetch: start gathering the next unit just before the current unit's
            forward (FSDP's ``forward_prefetch``; default False, as there).
        backward_prefetch: start gathering the unit whose backward comes next just before the
            current unit's backward (FSDP's ``BackwardPrefetch.BACKWARD_PRE``, its default;
            False is FSDP's ``backward_prefetch=None``).
        group: the data-parallel group (default: the world).
        ignored_params: parameters left alone, neither broadcast nor sharded nor reduced (FSDP's
            ``ignored_params``): e.g. experts that differ across ranks, handled by another
            optimizer over another group.

    With both prefetches off at most one unit is whole at a time; each one that is on lets two
    be whole during its pass. Both defaults are PyTorch FSDP's (a test reads them from it).

    Call the wrapper, ``model(x)``: it gathers the root unit first. A method of
    ``model.module`` that calls ``self(...)`` bypasses the wrapper and sees empty parameters.
    """

    def __init__(self, module: nn.Module, optimizer_cls, units=None, *,
                 forward_prefetch: bool = False, backward_prefetch: bool = True, group=None,
                 ignored_params=(), **kwargs):
        super().__init__()
        if "prefetch" in kwargs:  # else it goes to the optimizer, which says only "unexpected"
            raise TypeError("ZeroDataParallel takes forward_prefetch= and backward_prefetch= "
                            f"(PyTorch FSDP's names), not prefetch={kwargs['prefetch']!r}")
        self.forward_prefetch = boolean("forward_prefetch", forward_prefetch)
        self.backward_prefetch = boolean("backward_prefetch", backward_prefetch)
        self.ignored_params = list(ignored_params)
        ignored = {id(p) for p in self.ignored_params}
        check_params(p for p in module.parameters() if id(p) not in ignored)
        self.module, self.group = module, group
        self.world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        root = ops.group_ranks(group)[0]
        with torch.no_grad():
            for p in module.parameters():
                if id(p) not in ignored:
                    ops.broadcast(p.data, root, group)
        self.root, self.units = self._make_units(module, units, rank)
        self.all_units = ([self.root] if self.root else []) + self.units
        self.device_type = self.all_units[0].shard.device.type
        # units launch their reduce-scatter as soon as their gradients are complete (the
        # reverse of the forward's order, the same on every rank); unused ones and the root
        # at the end of backward
        self._through: dict[_Unit, set] = {}  # a late unit's parameters through a backward
        self.launcher = BucketLauncher(self.all_units, ordered=False, launch=self._launch,
                                       finish=self._finish_unit)
        self.optimizer = _ShardOptimizer(self, optimizer_cls([u.master for u in self.all_units],
                                                             **kwargs))
        self._order: list[_Unit] = []  # units in the order the last forward ran them
        self.gathered_bytes = 0
        self._root_held = False  # root_gathered: no backward's end frees the root
        self.peak_gathered_bytes = 0
        self.memory_timeline: list[tuple[float, int, str]] = []  # (time, bytes gathered, event)
        for unit, mod in zip(self.units, self._unit_modules, strict=True):
            mod.register_forward_pre_hook(lambda _m, _a, u=unit: self._before_forward(u))
            mod.register_forward_hook(lambda _m, _a, out, u=unit: self._after_forward(u, out))
        for p in self.launcher.bucket_of:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        mark_held_by(self.launcher.bucket_of, self)  # module.parameters() are empty between uses

    def _make_units(self, module, units, rank):
        if units is None:
            units = [m for m in module.modules() if any(True for _ in m.parameters(False))]
        units = list(units)
        claimed: dict[nn.Parameter, int] = {}
        ignored = {id(p) for p in self.ignored_params}
        for i, mod in enumerate(units):
            for p in mod.parameters():
                if p.requires_grad and id(p) not in ignored:
                    claimed.setdefault(p, i) if p not in claimed else claimed.__setitem__(p, -1)
        self._unit_modules, groups = [], []
        for i, mod in enumerate(units):
            mine = [p for p in mod.parameters() if claimed.get(p) == i]
            if mine:
                self._unit_modules.append(mod)
                groups.append((type(mod).__name__, list(dict.fromkeys(mine))))
        root = [p for p in dict.fromkeys(module.parameters())
                if p.requires_grad and claimed.get(p, -1) == -1 and id(p) not in ignored]
        if root:  # the root unit comes first: gathered for the whole step
            groups.insert(0, ("(root)", root))
        made = [_Unit(name, params, rank, self.world_size, i)
                for i, (name, params) in enumerate(groups)]
        return (made.pop(0) if root else None), made

    # -- bookkeeping of what is gathered ------------------------------------------------------

    def _start(self, unit: _Unit, event: str) -> None:
        if unit.full is None and unit.pending is None:
            unit.start_gather(self.group)
            self._account(unit.full_bytes, f"gather {unit.name} ({event})")

    def _gather(self, unit: _Unit, event: str) -> None:
        self._start(unit, event)
        unit.finish_gather()

    def _held(self, unit: _Unit) -> bool:
        return unit is self.root and self._root_held

    def _free(self, unit: _Unit, event: str) -> None:
        if self._held(unit):
            return
        if unit.full is not None:
            unit.free()
            self._account(-unit.full_bytes, f"free {unit.name} ({event})")

    def _account(self, delta: int, event: str) -> None:
        self.gathered_bytes += delta
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        self.memory_timeline.append((time.perf_counter(), self.gathered_bytes, event))

    # -- forward --------------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        self._order = []
        if self.root is not None:
            self._gather(self.root, "forward")
        # under autocast (entered here or inside the module), no bf16 copy kept for backward
        with recast_in_backward(self.launcher.bucket_of):
            return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def root_gathered(self):
        """The root unit whole through a pipeline step (the runtime calls the chunks, not
        this wrapper, and ends a backward at every B action), reduce-scattered at its end: a
        tied embedding under the V placement (ZB-V)."""
        root = self.root
        if root is None:
            yield
            return
        self._gather(root, "pipeline step")
        self._root_held = True
        try:
            yield
        except BaseException:  # a failed step: nothing of it is kept
            root.buffer = None
            raise
        finally:
            self._root_held = False
            if root.buffer is not None:  # the step's gradients of the root, once
                root.start_reduce_scatter(self.group).wait()
                root.add_reduced_grad()
            self._free(root, "end of pipeline step")

    def _before_forward(self, unit: _Unit) -> None:
        if not torch.is_grad_enabled() and unit.full is not None:
            return
        if self.backward_prefetch:  # the only reader of the order
            self._order.append(unit)
        self._gather(unit, "forward")
        if self.forward_prefetch:  # the next unit's gather overlaps with this unit's compute
            following = self._next_in(self.units, unit)
            if following is not None:
                self._start(following, "forward prefetch")

    def _after_forward(self, unit: _Unit, output) -> None:
        self._free(unit, "after forward")
        drop_autocast_cache(self.device_type)  # autocast's casts of the unit go with it
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda grad, u=unit: self._before_backward(u) or grad)
                    break

    @staticmethod
    def _next_in(order, unit):
        i = order.index(unit) if unit in order else -1
        return order[i + 1] if 0 <= i < len(order) - 1 else None

    # -- backward -------------------------------------------------------------------------------

    def _before_backward(self, unit: _Unit) -> None:
        self.launcher.end.queue()
        self._gather(unit, "backward")
        if self.backward_prefetch:  # backward runs the units in reverse
            earlier = self._next_in(self._order[::-1], unit)
            if earlier is not None and not earlier.ready:
                self._start(earlier, "backward prefetch")

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        unit = self.launcher.bucket_of[p]
        if self.is_late(unit):
            self._through_backward(unit, p)
            return
        unit.accumulate_grad(p)
        self.launcher.grad_ready(p, launch=unit is not self.root)  # the root waits for the end
        if unit.work is not None:  # its gradients are on their way: its parameters can go
            self._free(unit, "after backward")

    def _launch(self, unit: _Unit):
        if self.waits(unit):  # reduced once its late gradients are in (engine.zero.late), or
            return NOTHING_LAUNCHED  # at root_gathered's end
        return unit.start_reduce_scatter(self.group)

    def _through_backward(self, unit: _Unit, p: nn.Parameter) -> None:
        """A late unit's ``p`` is through this backward: a gradient from autograd waits in the
        buffer (none for a deferred weight: W adds it); once all its parameters are through,
        the unit is freed (W needs no weight), as a unit whose reduce-scatter started."""
        if p.grad is not None:
            unit.accumulate_grad(p)
        through = self._through.setdefault(unit, set())
        through.add(p)
        if len(through) == len(unit.params):
            through.clear()
            self._free(unit, "after backward (W later)")

    def _finish_unit(self, unit: _Unit) -> None:
        self._through.pop(unit, None)
        if not self.waits(unit):  # else it keeps its buffer
            unit.add_reduced_grad()
        if unit.pending is not None:  # prefetched, but its backward never came
            unit.finish_gather()
        self._free(unit, "end of backward")

    # -- gradients that arrive outside autograd (engine.zero.late) --------------------------

    reduce_every_late_bucket = False  # after a W: the units it filled (one chunk's)

    @property
    def late_units(self) -> list[_Unit]:
        """The units whose gradients (some of them) come in W actions (defer_gradients)."""
        return self.late_buckets

    def late_order(self) -> list[_Unit]:
        return self.all_units

    def may_reduce(self, unit: _Unit) -> bool:
        return not self._held(unit)  # a held root: reduce-scattered at root_gathered's end

    # -- measuring ------------------------------------------------------------------------------

    def state_tensors(self) -> StateTensors:
        """What this rank holds (see :mod:`engine.observe.memory`): shards of parameters and gradients,
        any unit still gathered, the optimizer state and the fp32 masters (where the shards
        are not fp32 themselves)."""
        params = [u.shard for u in self.all_units] + \
            [u.full for u in self.all_units if u.full is not None]
        optim = optimizer_tensors(self.optimizer.inner) + \
            [u.master for u in self.all_units if u.master.dtype != u.shard.dtype]
        return StateTensors(params=params, grads=[u.shard_grad for u in self.all_units] +
                            self.late_buffers(), optimizer=optim)

    def state_bytes(self) -> StateBytes:
        """Bytes this rank holds, each storage counted once."""
        return count_state_bytes(self.state_tensors())


class _ShardOptimizer:
    """``model.optimizer``: steps the inner optimizer on the shards, with their gradients."""

    def __init__(self, model: ZeroDataParallel, inner: torch.optim.Optimizer):
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
        self.model.drop_late_grads()  # what a step that failed part-way left for W

    @property
    def param_groups(self):
        return self.inner.param_groups

    def state_tensors(self) -> StateTensors:
        """The model's: the optimizer state lives with the shards it updates."""
        return self.model.state_tensors()


def _tensors(output):
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    return []
