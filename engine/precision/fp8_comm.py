"""An FP8 all-gather: the parameters of FSDP gathered in one byte per element.

With FP8 compute the all-gather of FSDP can carry FP8 too (torchao's float8 all-gather for
FSDP2, used by torchtitan): the bytes gathered are half of bf16's, a quarter of fp32's. Who
shares a scale is again the question, and two answers are built here:

* ``scale="tensor"``, torchao's and torchtitan's: **one scale per weight**. Each rank takes the
  amax of its shard, an all-reduce (max) makes it the weight's amax ("to keep single device
  semantics", torchtitan's docs/float8.md), and every rank casts its shard with that one scale:
  the gathered FP8 weight is exactly what one device would get by casting the whole weight.
  (torchao batches the amax all-reduces of all the weights into one,
  ``precompute_float8_dynamic_scale_for_fsdp``.)
* ``scale="shard"``, this engine's own variant: each rank casts its shard with **its own**
  scale, and the ``n`` fp32 scales are all-gathered beside the FP8 bytes. No all-reduce before
  the cast and a finer scale (a shard's amax is at most the weight's), but the gathered weight
  is no longer one device's cast: its values depend on how it was sharded.

DeepSeek-V3 (technical report, section 3.3.3) stores and communicates in FP8 too, but
activations: those dispatched to the MoE experts, not FSDP's weights. Gloo has no FP8 type, so
the bytes travel as ``uint8`` (a view, no copy). Every collective goes through
:mod:`engine.comm.ops`, so a :class:`engine.observe.meter.CommMeter` counts them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.comm import ops
from engine.precision.fp8 import dequantize, fp8_dtype, quantize, scale_for

SCALES = ("shard", "tensor")


def fp8_all_gather(shard: torch.Tensor, group=None, fmt: str = "e4m3",
                   scale: str = "shard") -> torch.Tensor:
    """The concatenation over the ranks of ``group`` of their (equal-sized) ``shard``, sent
    in FP8; returned dequantized, in fp32. ``scale="shard"``: one fp32 scale per rank,
    all-gathered after the FP8 bytes (this engine's variant); ``"tensor"``: one scale for the
    whole tensor, from an all-reduced amax before the cast (torchao's, torchtitan's)."""
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r}; expected one of {SCALES}")
    dtype = fp8_dtype(fmt)
    n = dist.get_world_size(group)
    flat = shard.detach().float().reshape(-1)
    amax = flat.abs().max().reshape(1)
    if scale == "tensor":
        ops.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    mine = scale_for(amax, dtype)
    payload = (flat / mine).to(dtype).view(torch.uint8)
    gathered = torch.empty(n * payload.numel(), dtype=torch.uint8, device=shard.device)
    ops.all_gather_into_tensor(gathered, payload, group=group)
    if scale == "tensor":
        scales = mine.expand(n)
    else:
        scales = torch.empty(n, dtype=torch.float32, device=shard.device)
        ops.all_gather_into_tensor(scales, mine, group=group)
    values = gathered.view(dtype).float().reshape(n, -1) * scales.unsqueeze(1)
    return values.reshape(n * shard.numel())


def fp8_cast(full: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """One device's per-tensor FP8 cast of ``full``, dequantized (fp32): what
    ``fp8_all_gather(..., scale="tensor")`` gathers, value for value."""
    row = full.detach().float().reshape(1, -1)
    return dequantize(*quantize(row, row.shape, fmt)).reshape(-1)  # one tile: the tensor


def plain_all_gather(shard: torch.Tensor, group=None, dtype=torch.bfloat16) -> torch.Tensor:
    """The same gather with the shard cast to ``dtype`` (bf16 by default), for comparison."""
    n = dist.get_world_size(group)
    payload = shard.detach().to(dtype).reshape(-1)
    gathered = torch.empty(n * payload.numel(), dtype=dtype, device=shard.device)
    ops.all_gather_into_tensor(gathered, payload, group=group)
    return gathered
