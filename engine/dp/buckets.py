"""Gradient buckets: the one mechanism data parallelism and every ZeRO stage share.

A *bucket* is a group of parameters laid out back to back in one flat buffer, so that one
collective moves all their gradients (Li et al., "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB 2020, section 3.2). Parameters go into buckets
*last first* (:func:`assign_buckets`): backward produces the last layer's gradients first, so
the first bucket is complete early and its collective runs while backward goes on computing
earlier layers.

:class:`BucketLauncher` is that overlap, written once: it keeps each bucket's *ready set*,
launches a bucket's collective once the set is complete, and at the end of backward (an
autograd callback, :class:`EndOfBackward`) launches what is left and finishes every bucket.
Data parallelism launches an all-reduce per bucket; ZeRO-2 and ZeRO-3 a reduce-scatter
(Rajbhandari et al., ZeRO, SC 2020, section 5), over buckets padded to a multiple of the
number of ranks so that each rank owns an equal slice (``pad_to``).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn


def assign_buckets(params: list[nn.Parameter], cap_bytes: int,
                   first_cap_bytes: int | None = None) -> list[list[nn.Parameter]]:
    """Group ``params`` (given in forward order) into buckets, last parameter first.

    A bucket is closed once it holds at least ``cap_bytes`` (the first one at
    ``first_cap_bytes``, if given); a parameter is never split across buckets. PyTorch's DDP
    closes its buckets by the same rule.
    """
    buckets: list[list[nn.Parameter]] = [[]]
    filled = 0
    for p in reversed(params):
        cap = first_cap_bytes if (first_cap_bytes and len(buckets) == 1) else cap_bytes
        if buckets[-1] and filled >= cap:
            buckets.append([])
            filled = 0
        buckets[-1].append(p)
        filled += p.numel() * p.element_size()
    return [b for b in buckets if b]


class EndOfBackward:
    """Runs ``fn`` once when the current backward pass finishes (queued from a grad hook)."""

    def __init__(self, fn: Callable[[], None]):
        self.fn, self.queued = fn, False

    def queue(self) -> None:
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._run)

    def _run(self) -> None:
        self.queued = False
        self.fn()


class GradBucket:
    """``params`` laid out back to back in one flat layout, and this backward's state.

    Layout: parameter ``p`` starts at ``offsets[p]`` and has shape ``shapes[p]``; ``numel``
    elements in all, zero-padded to ``padded``, a multiple of ``pad_to``.
    State: ``buffer`` (the flat gradient, laid out like the parameters), ``ready`` (the
    parameters whose gradient is in it), ``work`` (the collective in flight, ``None`` until
    launched). Compressors get this object, as PyTorch's comm hooks get a ``GradBucket``:
    ``index``, ``is_last``, ``params``, ``buffer`` and ``views``.
    """

    def __init__(self, params: list[nn.Parameter], index: int = 0, is_last: bool = False,
                 pad_to: int = 1):
        self.params, self.index, self.is_last = params, index, is_last
        self.shapes: dict[nn.Parameter, torch.Size] = {p: p.shape for p in params}
        self.offsets: dict[nn.Parameter, int] = {}
        at = 0
        for p in params:
            self.offsets[p] = at
            at += p.numel()
        self.numel = at
        self.padded = math.ceil(at / pad_to) * pad_to
        self.buffer: torch.Tensor | None = None
        self.ready: set[nn.Parameter] = set()
        self.work = None

    @property
    def complete(self) -> bool:
        """Every parameter's gradient is in ``buffer``."""
        return len(self.ready) == len(self.params)

    def view_of(self, p: nn.Parameter, flat: torch.Tensor) -> torch.Tensor:
        """``p``'s place in a bucket-shaped ``flat`` tensor, shaped like ``p``."""
        at, shape = self.offsets[p], self.shapes[p]
        return flat[at:at + shape.numel()].view(shape)

    def new_flat(self) -> torch.Tensor:
        """A zero tensor of ``padded`` elements, in the parameters' dtype and device."""
        first = self.params[0]
        return torch.zeros(self.padded, dtype=first.dtype, device=first.device)

    @property
    def views(self) -> dict[nn.Parameter, torch.Tensor]:
        """Each parameter's view of ``buffer``."""
        return {p: self.view_of(p, self.buffer) for p in self.params}


class NothingLaunched:
    """What ``launch`` returns for a bucket whose collective runs elsewhere (a zero-bubble
    pipeline's late gradients, reduced after W): nothing to wait for."""

    def wait(self) -> None:
        return None


NOTHING_LAUNCHED = NothingLaunched()


class BucketLauncher:
    """Launch each bucket's collective as soon as its gradients are in; finish them all at the
    end of backward.

    Args:
        buckets: in launch order.
        launch: ``launch(bucket) -> work`` starts the bucket's collective (asynchronously).
        finish: ``finish(bucket)`` runs after ``bucket.work.wait()``, at the end of backward.
        ordered: ``True``: buckets launch strictly in list order (a complete bucket waits for
            the ones before it), so every rank issues the same collectives in the same order
            even when its gradients arrive in another order (DDP, ZeRO-2). ``False``: each
            bucket launches as soon as it is complete (ZeRO-3, whose units complete in the
            reverse of the forward's order, the same on every rank).
        at_end: called first at the end of backward, before anything is launched or finished.

    The end of backward launches every bucket not launched yet (unused parameters, or no
    overlap), in list order, then waits on and finishes each bucket in list order.
    """

    def __init__(self, buckets: list[GradBucket], launch: Callable, finish: Callable,
                 ordered: bool = True, at_end: Callable[[], None] | None = None):
        self.buckets, self.ordered = buckets, ordered
        self._launch, self._finish, self._at_end = launch, finish, at_end
        self.bucket_of = {p: b for b in buckets for p in b.params}
        self.end = EndOfBackward(self._end_of_backward)

    def grad_ready(self, p: nn.Parameter, launch: bool = True) -> GradBucket:
        """Mark ``p``'s gradient as in its bucket's ``buffer``; launch what may start now
        (nothing when ``launch`` is false). Returns ``p``'s bucket."""
        self.end.queue()
        bucket = self.bucket_of[p]
        bucket.ready.add(p)
        if launch:
            candidates = self.buckets if self.ordered else [bucket]
            for b in candidates:
                if not b.complete:
                    break
                if b.work is None:
                    b.work = self._launch(b)
        return bucket

    def _end_of_backward(self) -> None:
        if self._at_end is not None:
            self._at_end()
        for b in self.buckets:
            if b.work is None:
                b.work = self._launch(b)
        for b in self.buckets:
            b.work.wait()
            self._finish(b)
            b.work = None
            b.ready.clear()
