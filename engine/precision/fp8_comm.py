"""An FP8 all-gather: the parameters of FSDP gathered in one byte per element.

With FP8 compute the all-gather of FSDP can carry FP8 too (torchao's float8 all-gather for
FSDP2; DeepSeek-V3, section 3.3.4, caches and dispatches activations in FP8): each rank casts
its shard to FP8 with its own per-tensor scale, the FP8 bytes are gathered (half of bf16's,
a quarter of fp32's), and the scales, one fp32 per rank, beside them. Gloo has no FP8 type, so
the bytes travel as ``uint8`` (a view, no copy). Every collective goes through
:mod:`engine.comm.ops`, so a :class:`engine.comm.CommMeter` counts them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.comm import ops
from engine.precision.fp8 import fp8_dtype


def fp8_all_gather(shard: torch.Tensor, group=None, fmt: str = "e4m3") -> torch.Tensor:
    """The concatenation over the ranks of ``group`` of their (equal-sized) ``shard``, sent
    in FP8 with one fp32 scale per rank; returned dequantized, in fp32."""
    dtype = fp8_dtype(fmt)
    n = dist.get_world_size(group)
    flat = shard.detach().float().reshape(-1)
    amax = flat.abs().max()
    scale = torch.where(amax > 0, amax / torch.finfo(dtype).max, torch.ones_like(amax))
    payload = (flat / scale).to(dtype).view(torch.uint8)
    gathered = torch.empty(n * payload.numel(), dtype=torch.uint8, device=shard.device)
    ops.all_gather_into_tensor(gathered, payload, group=group)
    scales = torch.empty(n, dtype=torch.float32, device=shard.device)
    ops.all_gather_into_tensor(scales, scale.reshape(1), group=group)
    values = gathered.view(dtype).float().reshape(n, -1) * scales.unsqueeze(1)
    return values.reshape(n * shard.numel())


def plain_all_gather(shard: torch.Tensor, group=None, dtype=torch.bfloat16) -> torch.Tensor:
    """The same gather with the shard cast to ``dtype`` (bf16 by default), for comparison."""
    n = dist.get_world_size(group)
    payload = shard.detach().to(dtype).reshape(-1)
    gathered = torch.empty(n * payload.numel(), dtype=dtype, device=shard.device)
    ops.all_gather_into_tensor(gathered, payload, group=group)
    return gathered
