"""Reference for exercise ch03.topk_error_feedback."""

import math

import torch

from engine.compress.topk import INDEX_DTYPE
from engine.comm import ops


class TopKWithErrorFeedback:
    """A compressor: ``DataParallel(model, compressor=TopKWithErrorFeedback(0.01))``."""

    def __init__(self, ratio: float):
        self.ratio = ratio
        self.residuals: dict[int, torch.Tensor] = {}  # bucket index -> what was not sent yet
        self.last_sent: dict[int, torch.Tensor] = {}  # bucket index -> what it sent, dense

    def compress(self, gradient: torch.Tensor, residual: torch.Tensor | None):
        """Return ``(values, indices, new_residual)``.

        Add the residual (if any) to the gradient, keep the ``k = ceil(ratio * numel)`` (at
        least 1) coordinates of largest magnitude, and return their values, their indices, and
        everything else as the new residual: a vector with zeros where a coordinate was sent.
        Do not change ``gradient`` in place.
        """
        corrected = gradient if residual is None else gradient + residual
        k = max(1, math.ceil(self.ratio * corrected.numel()))
        indices = corrected.abs().topk(k, sorted=False).indices
        values = corrected[indices]
        new_residual = corrected.clone()
        new_residual[indices] = 0
        return values, indices, new_residual

    # -- given: the exchange ----------------------------------------------------------------

    def __call__(self, bucket, group=None):
        values, indices, self.residuals[bucket.index] = self.compress(
            bucket.buffer, self.residuals.get(bucket.index))
        sent = torch.zeros_like(bucket.buffer)
        sent[indices] = values
        self.last_sent[bucket.index] = sent
        n = torch.distributed.get_world_size(group)
        all_values = values.new_empty(n * values.numel())
        all_indices = torch.empty(n * indices.numel(), dtype=INDEX_DTYPE)
        ops.all_gather_into_tensor(all_values, values.contiguous(), group=group)
        ops.all_gather_into_tensor(all_indices, indices.to(INDEX_DTYPE), group=group)
        bucket.buffer.zero_().index_add_(0, all_indices.long(), all_values).div_(n)
        return _Done()


class _Done:
    def wait(self):
        return True
