"""Quantization by casting: send the bucket in 16 bits, half the bytes of fp32.

Same steps as PyTorch's ``fp16_compress_hook`` / ``bf16_compress_hook``
(torch.distributed.algorithms.ddp_comm_hooks.default_hooks): cast, divide by the world size
in 16 bits (so the sum cannot overflow fp16's 65504 as easily), all-reduce, cast back.

fp16 keeps 10 mantissa bits and a 5-bit exponent (tiny gradients underflow to 0 below about
6e-8); bf16 keeps fp32's 8-bit exponent and only 7 mantissa bits (no underflow, coarser).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.comm import ops
from engine.compress.base import Then, check_float_bucket


class Cast:
    """Send the bucket as ``dtype``; receive the average, cast back into the bucket."""

    def __init__(self, dtype: torch.dtype):
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"cast to torch.float16 or torch.bfloat16, got {dtype!r}")
        self.dtype = dtype

    def __call__(self, bucket, group=None):
        check_float_bucket(bucket.buffer, type(self).__name__)
        wire = bucket.buffer.to(self.dtype).div_(dist.get_world_size(group))
        work = ops.all_reduce(wire, group=group, async_op=True)
        return Then(work, lambda: bucket.buffer.copy_(wire))

    def state_tensors(self) -> list[torch.Tensor]:
        """What it keeps between steps (see :mod:`engine.observe.memory`): nothing."""
        return []

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FP16(Cast):
    def __init__(self):
        super().__init__(torch.float16)


class BF16(Cast):
    def __init__(self):
        super().__init__(torch.bfloat16)
