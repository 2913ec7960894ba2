"""How many bytes this rank holds: model states (params, grads, optimizer) and activations.

The ZeRO paper (Rajbhandari et al., 2020, section 3.1) splits training memory into *model
states* (parameters, gradients, optimizer states: 2Ψ + 2Ψ + 12Ψ bytes for mixed-precision Adam
with Ψ parameters) and *residual states* (activations, buffers). This module measures both on a
live rank.

Bytes are counted per unique storage: two tensors that share memory (tied weights, views into
one flat buffer, ZeRO shards) are counted once. On the CPU that count matches the formulas
exactly; process RSS does not (the allocator and the interpreter add noise), and
``tracemalloc`` does not see tensors at all (DESIGN.md section 6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass(frozen=True)
class StateBytes:
    """Bytes held by this rank. ``total`` counts a storage shared between fields once."""

    params: int
    grads: int
    optimizer: int
    total: int
    memory_allocated: int | None = None  # CUDA only: torch.cuda.memory_allocated()
    max_memory_allocated: int | None = None  # CUDA only: the peak since the last reset


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    storage = t.untyped_storage()
    if storage.nbytes() == 0 or t.device.type == "meta":
        return None
    return (str(t.device), storage.data_ptr())


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


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
                      ) -> StateBytes:
    """Bytes this rank holds for ``model``'s parameters and gradients and ``optimizer``'s state.

    For fp32 Adam after one step this is exactly ``4Ψ`` / ``4Ψ`` / ``8Ψ`` plus one 4-byte
    ``step`` counter per parameter tensor. Each field counts its own unique storages; ``total``
    counts every storage once even if it appears in two fields.
    """
    params = [p for p in model.parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    opt = optimizer_tensors(optimizer) if optimizer is not None else []
    counted = count_state_bytes(params, grads, opt)
    if any(p.is_cuda for p in params):
        counted = StateBytes(counted.params, counted.grads, counted.optimizer, counted.total,
                             torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated())
    return counted


def count_state_bytes(params: Iterable[torch.Tensor], grads: Iterable[torch.Tensor],
                      optimizer: Iterable[torch.Tensor]) -> StateBytes:
    """:class:`StateBytes` of three groups of tensors, each storage counted once per field
    and once in ``total`` (a storage shared between two fields is not counted twice)."""
    groups = [list(params), list(grads), list(optimizer)]
    seen: set = set()
    total = sum(unique_storage_bytes(group, seen) for group in groups)
    return StateBytes(params=unique_storage_bytes(groups[0]),
                      grads=unique_storage_bytes(groups[1]),
                      optimizer=unique_storage_bytes(groups[2]), total=total)


class ActivationTracker:
    """Count the bytes autograd saves for backward while the context is open.

    Uses ``torch.autograd.graph.saved_tensors_hooks``: every tensor saved by a forward op passes
    through the pack hook. Parameters saved by an op (a linear layer saves its weight) are not
    activations, so storages already counted elsewhere can be excluded with ``exclude``::

        with ActivationTracker(exclude=model.parameters()) as acts:
            loss = model(x).sum()
        acts.bytes  # activation memory held until backward
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._seen = {k for k in (_storage_key(t) for t in exclude) if k is not None}
        self.bytes = 0
        self.count = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key is not None and key not in self._seen:
            self._seen.add(key)
            self.bytes += t.untyped_storage().nbytes()
            self.count += 1
        return t

    def __enter__(self) -> "ActivationTracker":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
