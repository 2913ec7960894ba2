"""Sparsification: send only the k largest-magnitude coordinates, with error feedback.

Each rank keeps ``k = ceil(ratio * numel)`` coordinates of its bucket and sends their values
and their indices; the ranks' choices differ, so the exchange is an **all-gather** of (values,
indices), not an all-reduce, and every rank receives ``(N - 1) * k`` pairs: the traffic grows
with N (Aji & Heafield, "Sparse communication for distributed gradient descent", EMNLP 2017;
Lin et al., "Deep gradient compression", ICLR 2018).

Dropping coordinates biases the update: a small but consistent gradient is never sent.
**Error feedback** (Seide et al. 2014, "1-bit SGD"; Karimireddy et al. 2019, "Error feedback
fixes SignSGD") keeps what was not sent in a residual and adds it to the next gradient, so
every coordinate is eventually delivered. The invariant, per bucket and step, exactly:

    sent + new_residual == gradient + old_residual
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from engine.comm import ops
from engine.compress.base import Done, check_float_bucket, check_ratio

INDEX_DTYPE = torch.int32  # 4 bytes per index on the wire, as many as an fp32 value


class TopK:
    """Keep the ``ratio`` largest-magnitude coordinates of each bucket.

    ``residuals[bucket.index]`` is the error-feedback memory; ``last_sent[bucket.index]`` the
    dense vector this rank sent last (for the invariant's tests and plots).
    """

    def __init__(self, ratio: float, error_feedback: bool = True):
        self.ratio = check_ratio(ratio)
        self.error_feedback = bool(error_feedback)
        self.residuals: dict[int, torch.Tensor] = {}
        self.last_sent: dict[int, torch.Tensor] = {}

    def k(self, numel: int) -> int:
        return max(1, math.ceil(self.ratio * numel))

    def select(self, vector: torch.Tensor) -> torch.Tensor:
        """Indices of the coordinates to send (largest magnitude)."""
        return vector.abs().topk(self.k(vector.numel()), sorted=False).indices

    def state_tensors(self) -> list[torch.Tensor]:
        """What it keeps between steps (see :mod:`engine.observe.memory`): the error-feedback residuals
        and the last selection of each bucket."""
        return [*self.residuals.values(), *self.last_sent.values()]

    def __call__(self, bucket, group=None):
        buffer = bucket.buffer
        check_float_bucket(buffer, type(self).__name__)
        if self.error_feedback and bucket.index in self.residuals:
            corrected = buffer + self.residuals[bucket.index]
        else:
            corrected = buffer.clone()
        index = self.select(corrected)
        values = corrected[index]
        sent = torch.zeros_like(corrected)
        sent[index] = values
        if self.error_feedback:
            self.residuals[bucket.index] = corrected - sent  # exactly what was not sent
        self.last_sent[bucket.index] = sent
        n = dist.get_world_size(group)
        all_values = values.new_empty(n * values.numel())
        all_index = torch.empty(n * index.numel(), dtype=INDEX_DTYPE, device=index.device)
        ops.all_gather_into_tensor(all_values, values.contiguous(), group=group)
        ops.all_gather_into_tensor(all_index, index.to(INDEX_DTYPE), group=group)
        buffer.zero_().index_add_(0, all_index.long(), all_values).div_(n)
        return Done()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ratio={self.ratio}, error_feedback={self.error_feedback})"


class RandomK(TopK):
    """Keep ``ratio`` of the coordinates chosen uniformly at random (the same on every rank,
    from a shared seed, so the values could be all-reduced; here they travel like Top-K's)."""

    def __init__(self, ratio: float, error_feedback: bool = True, seed: int = 0):
        super().__init__(ratio, error_feedback)
        self.generator = torch.Generator().manual_seed(seed)

    def select(self, vector: torch.Tensor) -> torch.Tensor:
        perm = torch.randperm(vector.numel(), generator=self.generator)
        return perm[:self.k(vector.numel())].to(vector.device)
