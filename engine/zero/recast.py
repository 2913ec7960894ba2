"""Autocast's weight casts, cast again in backward instead of kept: what lets ZeRO-3 free what
it gathered under bf16 autocast.

Under ``torch.autocast`` a linear layer runs on ``W.to(bf16)``, a new tensor that autograd
saves for backward (the input's gradient needs it) and that autocast also caches until the
outermost autocast region ends. ZeRO-3 frees a unit's full parameters after its forward, but
that bf16 copy of them would stay alive until the unit's backward: about 2Ψ bytes over all
units at once, the memory parameter sharding is meant to save, and invisible to
``peak_gathered_bytes``. Inside :func:`recast_in_backward` a saved tensor that is a cast of
one of the given parameters is saved as a :class:`Recast` (the parameter and the dtype) and
cast again when backward needs it, by which time ZeRO-3 has gathered the unit again; and
:func:`drop_autocast_cache` frees autocast's cache after each unit's forward. (PyTorch's FSDP
avoids the copy another way: with ``MixedPrecision(param_dtype=torch.bfloat16)`` it gathers
the parameters in bf16, so the saved tensor is the gathered storage itself, freed and
refilled in place.)
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

import torch
from torch import nn


class Recast(NamedTuple):
    """What autograd keeps instead of ``param.to(dtype)`` (or a view of it, such as the
    transpose a linear layer saves): cast again, and viewed the same way, when unpacked."""

    param: nn.Parameter
    dtype: torch.dtype
    size: tuple
    stride: tuple
    offset: int

    def unpack(self) -> torch.Tensor:
        cast = self.param.detach().to(self.dtype)
        return cast.as_strided(self.size, self.stride, self.offset)


def recast_in_backward(params: Iterable[nn.Parameter]):
    """A context in which autograd saves, instead of a cast of one of ``params`` (autocast's
    ``W.to(bf16)``) or a view of one, a :class:`Recast` of it (see the module docstring).
    Casting again gives the same values, so this is exact whatever made the cast; it is
    decided per saved tensor (autocast may be entered inside the wrapped module, and inside
    autograd's saving ``torch.is_autocast_enabled`` reads False)."""
    by_id = {id(p): p for p in params}

    def pack(tensor: torch.Tensor):
        cast = tensor if tensor._base is None else tensor._base
        fn = cast.grad_fn
        if fn is not None and fn.name() == "ToCopyBackward0":
            source = getattr(fn.next_functions[0][0], "variable", None)
            if source is not None and by_id.get(id(source)) is source:
                return Recast(source, tensor.dtype, tuple(tensor.shape), tensor.stride(),
                              tensor.storage_offset())
        return tensor

    def unpack(saved):
        return saved.unpack() if isinstance(saved, Recast) else saved

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def autocast_on(device_type: str) -> bool:
    """Whether ``torch.autocast`` is on for ``device_type`` here."""
    return torch.is_autocast_enabled(device_type)


def drop_autocast_cache(device_type: str) -> None:
    """Free autocast's cached casts (of the unit that just ran) while autocast is on."""
    if autocast_on(device_type):
        torch.clear_autocast_cache()
