"""Gradients that arrive outside autograd: a zero-bubble pipeline's W actions, for the ZeRO
stages that reduce gradients during backward.

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), split a linear layer's backward in
two: B gives the input gradient at once (the previous stage waits for it), W the weight
gradient ``dW = dY^T X`` later, in what would be a bubble (:mod:`engine.pp.weight_grad`).
ZeRO-2 (:mod:`engine.zero.stage2`) and ZeRO-3 (:mod:`engine.zero.stage3`) reduce-scatter each
bucket of gradients when a backward pass has filled it; W's gradients come after that.
:class:`LateGradients` is what both add, the same way:

* :meth:`~LateGradients.defer_gradients` names the parameters whose gradients W brings; their
  buckets are *late*: the end of a backward pass leaves their gradient buffers as they are;
* :meth:`~LateGradients.add_late_grad` adds a W's ``dW`` (and ``db``) to its place in the
  buffer (ZeRO-3: nothing is gathered, W needs no weight);
* :meth:`~LateGradients.reduce_late_grads`, after each W, reduce-scatters: ZeRO-2 every late
  bucket, as each backward pass reduce-scatters every bucket (zeros where nothing came), so a
  step sends ``m x chunks`` of each whatever the buckets hold; ZeRO-3 the units this W filled
  (a unit holds one module of one chunk), ``m`` a step;
* :meth:`~LateGradients.flush_late_grads` reduce-scatters what still waits (a backward pass
  not split into B and W), before the step;
* :meth:`~LateGradients.drop_late_grads` forgets a failed step's partial buffers.
"""

from __future__ import annotations

import torch
from torch import nn


class LateGradients:
    """The late-gradient half of a holder of sharded gradient buckets (module docstring). The
    holder has ``launcher.bucket_of`` (parameter -> bucket), ``group``, :meth:`late_order`
    (its buckets in one order on every rank) and may refuse to reduce a bucket yet
    (:meth:`may_reduce`)."""

    late_buckets: tuple | list = ()  # a list once defer_gradients names some, in order
    _late: frozenset | set = frozenset()  # the same, for membership tests in backward hooks
    _filled: tuple | list = ()  # the late buckets the current W has added to
    reduce_every_late_bucket = True  # ZeRO-2: after each W; False (ZeRO-3): those W filled

    def late_order(self) -> list:
        raise NotImplementedError

    def may_reduce(self, bucket) -> bool:
        return True

    def defer_gradients(self, params) -> None:
        """The buckets holding ``params`` get (some of) their gradients outside autograd,
        through :meth:`add_late_grad`."""
        late = {self.launcher.bucket_of[p] for p in params if p in self.launcher.bucket_of}
        self.late_buckets = [b for b in self.late_order() if b in late]
        self._late, self._filled = late, []

    def holds(self, p) -> bool:
        """Whether ``p``'s gradient goes into one of these buckets."""
        return p in self.launcher.bucket_of

    def is_late(self, bucket) -> bool:
        return bucket in self._late

    def waits(self, bucket) -> bool:
        """Whether the end of a backward pass leaves ``bucket``'s gradients in its buffer
        rather than reduce-scattering them: late (W reduces it) or not to be reduced yet."""
        return bucket in self._late or not self.may_reduce(bucket)

    def add_late_grad(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """Add ``grad`` (``p``'s shape) to ``p``'s place in its bucket's gradient buffer."""
        bucket = self.launcher.bucket_of.get(p)
        if not self.is_late(bucket):
            raise ValueError(f"a gradient of shape {tuple(grad.shape)} came outside autograd "
                             "for a parameter not declared with defer_gradients (its bucket "
                             f"{getattr(bucket, 'name', '')!r} was reduce-scattered already)")
        if bucket.buffer is None:
            bucket.buffer = bucket.new_flat()
        bucket.view_of(p, bucket.buffer).add_(grad)
        if bucket not in self._filled:
            self._filled.append(bucket)

    def reduce_late_grads(self) -> None:
        """After a W action: reduce-scatter the late buckets (module docstring), in the
        buckets' order, the same on every rank of the group."""
        chosen = self.late_buckets if self.reduce_every_late_bucket else \
            [b for b in self.late_buckets if b in self._filled]
        self._filled = []
        for bucket in chosen:
            if self.may_reduce(bucket):
                self._reduce(bucket)

    def flush_late_grads(self) -> None:
        """Reduce-scatter every late bucket whose buffer still holds gradients."""
        for bucket in self.late_buckets:
            if bucket.buffer is not None and self.may_reduce(bucket):
                self._reduce(bucket)

    def drop_late_grads(self) -> None:
        """Forget what waits in the late buffers (a step that failed part-way)."""
        for bucket in self.late_buckets:
            bucket.buffer = None
        self._filled = []

    def late_buffers(self) -> list[torch.Tensor]:
        """The full-size gradient buffers waiting for W now: memory this rank holds."""
        return [b.buffer for b in self.late_buckets if b.buffer is not None]

    def _reduce(self, bucket) -> None:
        bucket.start_reduce_scatter(self.group).wait()  # zeros where no gradient came
        bucket.add_reduced_grad()
