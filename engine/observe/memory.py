"""How many bytes this rank holds: model states (params, grads, optimizer) and activations.

The ZeRO paper (Rajbhandari et al., 2020, section 3.1) splits training memory into *model
states* (parameters, gradients, optimizer states: 2Ψ + 2Ψ + 12Ψ bytes for mixed-precision Adam
with Ψ parameters) and *residual states* (activations, buffers). This module measures both on a
live rank.

Every strategy answers "what do I hold?" through one protocol: a method ``state_tensors()``
returning :class:`StateTensors` (its parameters, gradients, optimizer state, communication
buffers and host-offloaded tensors). :func:`model_state_bytes` counts those; a plain
``nn.Module`` (tensor- and pipeline-parallel modules keep their shards as ordinary parameters)
and a plain ``torch.optim.Optimizer`` are counted directly, and anything else is a
``TypeError``, never a silent 0.

Bytes are counted per unique storage: two tensors that share memory (tied weights, views into
one flat buffer, ZeRO shards) are counted once. On the CPU that count matches the formulas
exactly; process RSS does not (the allocator and the interpreter add noise), and
``tracemalloc`` does not see tensors at all: it traces Python's allocator, and tensor storage
is allocated outside it.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field, replace
from typing import Iterable

import torch
from torch import nn


@dataclass(frozen=True)
class StateBytes:
    """Bytes held by this rank, each storage counted once per field.

    ``params``, ``grads`` and ``optimizer`` are the ZeRO paper's model states (section 3.1).
    ``buffers`` are communication buffers kept between steps (data parallelism's gradient
    buckets: one of the paper's residual states, "temporary buffers", section 3.2).
    ``total`` is everything on the device: those four, a storage shared between fields counted
    once. ``offloaded`` is kept in host memory instead (ZeRO-Offload's fp32 master weights and
    optimizer state) and is not in ``total``.
    """

    params: int
    grads: int
    optimizer: int
    total: int
    buffers: int = 0
    offloaded: int = 0
    memory_allocated: int | None = None  # CUDA only: torch.cuda.memory_allocated()
    max_memory_allocated: int | None = None  # CUDA only: the peak since the last reset


@dataclass
class StateTensors:
    """What one strategy holds on this rank, by kind: the answer of ``state_tensors()``.

    Fields as in :class:`StateBytes`. A tensor may be listed by two holders (a model and its
    optimizer both list the parameters): storages are counted once.
    """

    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    optimizer: list[torch.Tensor] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)
    offloaded: list[torch.Tensor] = field(default_factory=list)

    def __add__(self, other: "StateTensors") -> "StateTensors":
        return StateTensors(self.params + other.params, self.grads + other.grads,
                            self.optimizer + other.optimizer, self.buffers + other.buffers,
                            self.offloaded + other.offloaded)


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    """What tells two storages apart: the storage object itself (every view of a tensor shares
    it), not its data's address, which a storage freed in place (``resize_(0)``, as ZeRO-3
    frees its whole parameters) hands on to the next allocation while the storage lives on;
    and a meta tensor (a dry run's) has no address at all."""
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return None
    return (str(t.device), storage._cdata)


def unique_storage_bytes(tensors: Iterable[torch.Tensor], seen: set | None = None) -> int:
    """Sum the bytes of the distinct storages behind ``tensors`` (skipping keys in ``seen``).

    ``seen`` is updated in place, so successive calls never count a storage twice.
    """
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        key = _storage_key(t)
        if key is None or key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in ``optimizer.state`` (Adam: ``exp_avg``, ``exp_avg_sq`` and ``step``)."""
    found = []
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                found.append(value)
    return found


def mark_held_by(params: Iterable[nn.Parameter], holder) -> None:
    """Record that ``holder`` keeps ``params``' memory (ZeRO-3 empties ``param.data`` between
    uses): counting a module with these parameters counts ``holder`` instead."""
    for p in params:
        p._state_holder = weakref.ref(holder)


def module_state_tensors(module: nn.Module) -> StateTensors:
    """A plain module's state: its parameters and their ``.grad``; for parameters whose memory
    a strategy took over (:func:`mark_held_by`), that strategy's state."""
    params = list(module.parameters())
    held = StateTensors(params=params, grads=[p.grad for p in params if p.grad is not None])
    holders = {}
    for p in params:
        ref = getattr(p, "_state_holder", None)
        if ref is not None and ref() is not None:
            holders[id(ref())] = ref()
    for holder in holders.values():
        held = held + holder.state_tensors()
    return held


def state_tensors_of(holder) -> StateTensors:
    """The protocol: ``holder.state_tensors()`` where it has one; a plain module's parameters
    and gradients; a plain optimizer's state. Anything else is a TypeError."""
    if callable(getattr(holder, "state_tensors", None)):
        return holder.state_tensors()
    if isinstance(holder, nn.parallel.DistributedDataParallel):
        raise TypeError(
            "model_state_bytes cannot count a DistributedDataParallel: its gradient buckets "
            "live in its C++ reducer, out of sight (the gradients' size again, unless "
            "gradient_as_bucket_view=True). Count model_state_bytes(ddp.module) and add them, "
            "or use engine.dp.DataParallel, which reports its buckets")
    if isinstance(holder, nn.Module):
        return module_state_tensors(holder)
    if isinstance(holder, torch.optim.Optimizer):
        inner = _torch_zero_inner(holder)
        return StateTensors(optimizer=optimizer_tensors(inner or holder))
    raise TypeError(
        f"model_state_bytes cannot count a {type(holder).__name__}: expected an nn.Module, a "
        "torch.optim.Optimizer, or an object with a state_tensors() method returning "
        "engine.observe.memory.StateTensors (every engine strategy has one)")


def _torch_zero_inner(optimizer: torch.optim.Optimizer):
    """PyTorch's ZeroRedundancyOptimizer keeps its shard's state in ``.optim``, not in
    ``.state``: the optimizer to read, or None for any other optimizer."""
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer):
        return optimizer.optim
    return None  # not one (if it were, its module would be imported)


def model_state_bytes(model, optimizer=None) -> StateBytes:
    """Bytes this rank holds for ``model`` and ``optimizer`` (see :class:`StateBytes`).

    ``model`` is a module or any strategy (``DataParallel``, ``ZeroDataParallel``, ...);
    ``optimizer`` a plain optimizer, a ``ZeroOptimizer`` or ``ZeroDataParallel.optimizer``.
    For fp32 Adam after one step this is exactly ``4Ψ`` / ``4Ψ`` / ``8Ψ`` plus one 4-byte
    ``step`` counter per parameter tensor. Raises TypeError for what it cannot count.
    """
    held = state_tensors_of(model)
    if optimizer is not None:
        held = held + state_tensors_of(optimizer)
    counted = count_state_bytes(held)
    if any(t.is_cuda for t in held.params):
        counted = replace(counted, memory_allocated=torch.cuda.memory_allocated(),
                          max_memory_allocated=torch.cuda.max_memory_allocated())
    return counted


def count_state_bytes(held: StateTensors) -> StateBytes:
    """:class:`StateBytes` of ``held``: each storage counted once per field, and once in
    ``total`` (a storage shared between two device fields is not counted twice)."""
    device = [held.params, held.grads, held.optimizer, held.buffers]
    seen: set = set()
    total = sum(unique_storage_bytes(group, seen) for group in device)
    return StateBytes(params=unique_storage_bytes(held.params),
                      grads=unique_storage_bytes(held.grads),
                      optimizer=unique_storage_bytes(held.optimizer), total=total,
                      buffers=unique_storage_bytes(held.buffers),
                      offloaded=unique_storage_bytes(held.offloaded))


# Autograd nodes whose output holds its input's values: views (the same storage) and casts
# (``.to(dtype)``, autocast's copy of a weight). A saved tensor reached from a parameter through
# these only is that parameter, in another dtype or shape, not an activation.
CAST_AND_VIEW_NODES = frozenset({
    "ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0",
    "UnsafeViewBackward0", "ReshapeAliasBackward0", "ExpandBackward0", "AliasBackward0",
    "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2",
    "SliceBackward0", "SelectBackward0", "AsStridedBackward0"})


class ActivationTracker:
    """Count the bytes autograd saves for backward while the context is open.

    Uses ``torch.autograd.graph.saved_tensors_hooks``: every tensor saved by a forward op passes
    through the pack hook. Parameters saved by an op (a linear layer saves its weight) are not
    activations, so storages already counted elsewhere can be excluded with ``exclude``::

        with ActivationTracker(exclude=model.parameters()) as acts:
            loss = model(x).sum()
        acts.bytes  # activation memory held until backward

    Under autocast (bf16, the GPU default) a layer saves a low-precision copy of its weight, not
    the weight: a copy of an excluded parameter (reached from it through casts and views only,
    :data:`CAST_AND_VIEW_NODES`) is not an activation either. Its bytes, memory held until
    backward all the same, are in ``cast_bytes``. (A parameter that does not require grad has
    no such link: its copy is counted as an activation.)

    :meth:`held` is what is saved and still allocated *now* (between forward and backward:
    what the rank holds for backward); a storage freed since the op saved it, such as the
    whole parameters ZeRO-3 gathers and frees after each module's forward, counts 0 there.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._parameters = {k for k in (_storage_key(t) for t in exclude) if k is not None}
        self._seen = set(self._parameters)
        self.bytes = 0
        self.count = 0
        self.cast_bytes = 0  # copies of excluded parameters kept for backward (autocast's)
        self._saved: list[weakref.ref] = []  # every tensor saved, not excluded: for held()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key is not None and key not in self._parameters:
            self._saved.append(weakref.ref(t))
        if key is not None and key not in self._seen:
            self._seen.add(key)
            if self._is_parameter_copy(t):
                self.cast_bytes += t.untyped_storage().nbytes()
            else:
                self.bytes += t.untyped_storage().nbytes()
                self.count += 1
        return t

    def held(self) -> int:
        """Bytes now allocated of the storages saved while the context was open (parameters
        in ``exclude`` aside), each counted once: what autograd holds for backward now."""
        return unique_storage_bytes(t for ref in self._saved if (t := ref()) is not None)

    def _is_parameter_copy(self, t: torch.Tensor) -> bool:
        """Whether ``t`` comes from an excluded parameter through casts and views only, or
        is a parameter ZeRO-3 gathered whole (it carries its shard's ``fsdp_param``)."""
        if getattr(t, "fsdp_param", None) is not None:
            return True
        node = t.grad_fn
        while node is not None and node.name() in CAST_AND_VIEW_NODES:
            node = node.next_functions[0][0]
        leaf = getattr(node, "variable", None)  # an AccumulateGrad node holds its parameter
        return leaf is not None and _storage_key(leaf) in self._parameters

    def __enter__(self) -> "ActivationTracker":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
