"""``TunedZeroOptimizer``: :class:`~engine.zero.ZeroOptimizer` with its step's collectives on
the engine's tuned ring, for speed on Gloo. Read ``ZeroOptimizer`` to learn ZeRO; this file
only swaps how two collectives run.

Stage 1's step is a reduce-scatter of the gradients and an all-gather of the updated
parameters. Gloo's built-in ``reduce_scatter_tensor`` is slower than its own all-reduce of the
same tensor (measured on 4 ranks of a 2-core machine, 4.2 M fp32 elements: 45-50 ms against
25-32 ms), which made stage 1 slower than PyTorch's DDP + ``ZeroRedundancyOptimizer`` although
it sends less. The engine's pipelined ring (:mod:`engine.comm.ring_pipelined`) does the same
reduce-scatter in 33 ms and the all-gather in 16 ms (built-in: 22-29 ms); ``benchmarks/zero.py``
times both optimizers against PyTorch's (``benchmarks/README.md`` has the measurements).

The same algorithm (Patarasuk & Yuan's ring) and the same bytes on the wire,
``(N-1)/N`` of the bucket each; the sums are added in the ring's order, so the result equals
``ZeroOptimizer``'s to rounding, not bit for bit. On NCCL, for GPU tensors, and for dtypes
the ring does not take, the built-in collectives run, as in ``ZeroOptimizer``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.comm.checks import SUPPORTED_DTYPES
from engine.comm.ring_pipelined import (RingBuffers, ring_all_gather_pipelined,
                                        ring_reduce_scatter_pipelined)
from engine.observe.memory import StateTensors
from engine.zero.optimizer import ZeroOptimizer


class TunedZeroOptimizer(ZeroOptimizer):
    """``ZeroOptimizer`` (same arguments, same state, same checkpoints) whose step
    reduce-scatters and all-gathers on the engine's pipelined ring when the group is Gloo
    and the buckets are CPU tensors. It also holds the ring's scratch: two chunks of the
    largest bucket, 2/N of it, counted as ``buffers`` by ``state_tensors()`` once the first
    step has made it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ring_buffers = RingBuffers()  # the ring's scratch, reused every step

    def _on_ring(self, t: torch.Tensor) -> bool:
        return (dist.get_backend(self.group) == "gloo" and t.device.type == "cpu"
                and t.dtype in SUPPORTED_DTYPES)

    def _reduce_scatter(self, full: torch.Tensor, bucket) -> torch.Tensor:
        if not self._on_ring(full):
            return super()._reduce_scatter(full, bucket)
        # ``full`` is this step's own packed copy of the gradients: the ring's working buffer.
        # The sum is copied out so that ``full`` is freed now, as in ZeroOptimizer, not kept
        # alive by a view until the step ends.
        summed = ring_reduce_scatter_pipelined(full, self.group, "sum", check=False,
                                               buffers=self.ring_buffers)
        return summed.clone()

    def _all_gather(self, bucket) -> None:
        if not self._on_ring(bucket.flat):
            return super()._all_gather(bucket)
        # this rank's slice of ``flat`` is its updated shard already: the ring fills the rest
        ring_all_gather_pipelined(bucket.flat, self.group, check=False)

    def state_tensors(self) -> StateTensors:
        """``ZeroOptimizer``'s, plus the ring's scratch (two chunks of the largest bucket) as
        communication ``buffers``."""
        return super().state_tensors() + StateTensors(buffers=self.ring_buffers.tensors())
