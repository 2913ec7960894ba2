"""``MixedPrecisionPolicy``: what FSDP gathers the parameters in and what it reduces in.

Same fields and meaning as ``torch.distributed.fsdp.MixedPrecisionPolicy``: the sharded
parameters (and the optimizer's state) stay in their own dtype, fp32 masters; ``param_dtype``
is the dtype the shards are cast to before the all-gather (so the gather sends half of fp32's
bytes in bf16) and the module computes in; ``reduce_dtype`` the dtype gradients are
reduce-scattered in (``None``: the gradients' own, that is ``param_dtype``). The reduced
gradient is cast back to the shard's dtype.

The two things a :class:`engine.fsdp.group.ShardGroup` asks of its policy: the dtype it gathers
in (:meth:`MixedPrecisionPolicy.gather_dtype`) and its module's inputs cast to it
(:meth:`MixedPrecisionPolicy.cast_inputs`).
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

    def gather_dtype(self, params, owner: str) -> torch.dtype | None:
        """The dtype the shards ``params`` (:class:`engine.fsdp.shard.ShardedParam`) of the
        module ``owner`` are gathered in: ``param_dtype``, else theirs, which must then be one
        (``None``: no parameters)."""
        dtypes = {p.shard.dtype for p in params}
        if self.param_dtype is None and len(dtypes) > 1:
            raise ValueError(f"fully_shard({owner}): parameters of dtypes "
                             f"{sorted(map(str, dtypes))} gathered together; give "
                             "MixedPrecisionPolicy(param_dtype=...) or shard them apart")
        return self.param_dtype or (params[0].shard.dtype if params else None)

    def cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The module's floating-point inputs in ``param_dtype`` (``cast_forward_inputs``)."""
        if self.param_dtype is None or not self.cast_forward_inputs:
            return args, kwargs
        dtype = self.param_dtype

        def cast(x):
            return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}
