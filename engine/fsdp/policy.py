"""``MixedPrecisionPolicy``: what FSDP gathers the parameters in and what it reduces in.

Same fields and meaning as ``torch.distributed.fsdp.MixedPrecisionPolicy``: the sharded
parameters (and the optimizer's state) stay in their own dtype, fp32 masters; ``param_dtype``
is the dtype the shards are cast to before the all-gather (so the gather sends half of fp32's
bytes in bf16) and the module computes in; ``reduce_dtype`` the dtype gradients are
reduce-scattered in (``None``: the gradients' own, that is ``param_dtype``). The reduced
gradient is cast back to the shard's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    param_dtype: torch.dtype | None = None  # None: gather and compute in the shards' dtype
    reduce_dtype: torch.dtype | None = None  # None: reduce in the gradients' dtype
    cast_forward_inputs: bool = True  # floating inputs cast to param_dtype, as PyTorch's

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype)
                                          and value.is_floating_point):
                raise ValueError(f"MixedPrecisionPolicy({name}={value!r}): expected a floating "
                                 "point torch.dtype (torch.bfloat16, torch.float16, "
                                 "torch.float32) or None")
