"""Which ``fully_shard``-ed module is the root, decided at the first forward.

As PyTorch's FSDP2 does (``FSDPState._lazy_init``): the sharded module whose forward runs
first is the root, every sharded module inside it is not. The root keeps its parameters from
forward to backward (backward starts with them); it is decided then rather than at
``fully_shard`` time, when the modules around it may not be sharded yet. The root and every
group inside it share one :class:`engine.fsdp.prefetch.Prefetch`.
"""

from __future__ import annotations

from engine.fsdp.prefetch import Prefetch


def lazy_init(state) -> None:
    """Decide, once, that ``state`` (a :class:`engine.fsdp.group.ShardGroup`, its module about
    to run its first forward) is the root and that every sharded module inside it is not."""
    if state.is_root is not None:
        return
    state.is_root = True
    state.prefetch = Prefetch()  # one for the root and every group inside it
    for name, sub in state.module.named_modules():
        inner = getattr(sub, "fsdp_state", None)
        if sub is state.module or inner is None:
            continue
        if inner.is_root is not None:
            raise RuntimeError(
                f"fully_shard: {name!r} ({type(sub).__name__}) already ran forward as a "
                f"root before {type(state.module).__name__} did; run the first forward "
                "through the root module (as PyTorch's FSDP2 requires)")
        inner.is_root, inner.prefetch = False, state.prefetch
