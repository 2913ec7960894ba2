"""Which backend a launch runs on, and joining its process group: the one place that decides.

:func:`resolve_backend` is the only backend decision in the engine. ``"auto"`` has one meaning,
with one explicit choice for callers that want the GPUs when there are enough:

* ``engine.launch(fn, n)`` (the notebooks' lessons): ``"auto"`` is Gloo on every machine, and
  CUDA is asked nothing (a process that asked can no longer fork ranks that use CUDA).
* ``engine train --backend auto`` (``prefer_nccl=True``): NCCL when this machine has a GPU for
  each of its ranks and torch has NCCL, else Gloo.

``"nccl"`` asked for explicitly is checked either way: one GPU per rank on this machine.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.launch.device import local_gpu
from engine.validation import one_of

BACKENDS = ("auto", "gloo", "nccl")


def resolve_backend(backend: str, ranks_here: int, ranks_name: str = "world_size", *,
                    prefer_nccl: bool = False) -> str:
    """``"gloo"`` or ``"nccl"`` for the ``backend`` asked for (one of :data:`BACKENDS`).

    Args:
        backend: ``"gloo"``; ``"nccl"``, checked that this machine has a GPU for each of its
            ``ranks_here`` ranks; or ``"auto"``: Gloo, or with ``prefer_nccl`` NCCL when that
            check would pass (and torch has NCCL).
        ranks_here: the ranks that run on this machine: all of them for a local launch, or
            torchrun's ``LOCAL_WORLD_SIZE`` (the same on every process of a node, so every rank
            decides alike).
        ranks_name: where ``ranks_here`` came from, for the message.
        prefer_nccl: what ``"auto"`` means: False (``engine.launch``'s default) is Gloo on any
            machine, asking CUDA nothing; True (``engine train``) takes the GPUs if enough.

    Raises:
        ValueError: ``"nccl"`` on a machine without a GPU for every local rank, or without NCCL.
    """
    one_of("backend", backend, BACKENDS)
    if backend == "gloo" or (backend == "auto" and not prefer_nccl):
        return "gloo"
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if n_gpus >= ranks_here and dist.is_nccl_available() else "gloo"
    if n_gpus == 0:
        raise ValueError(
            "backend='nccl' needs CUDA GPUs, and this machine has none; "
            "use backend='gloo' (or 'auto') to run on the CPU"
        )
    if not dist.is_nccl_available():
        raise ValueError("backend='nccl': this build of torch has no NCCL; use backend='gloo'")
    if ranks_here > n_gpus:
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: {ranks_name}={ranks_here} but only "
            f"{n_gpus} GPU(s) are visible. Use backend='gloo' for more ranks than GPUs."
        )
    return backend


# ProcessGroupNCCL records a start event around every op only with this set when a group is
# created; then ``Work._get_duration()`` is NCCL's own timing of the op, which the CommMeter
# reports (engine.observe.durations). Its cost, in PyTorch's ProcessGroupNCCL.hpp: one more CUDA
# event per op, and the watchdog's queries of it. The older name is honoured as torch does.
NCCL_TIMING_VARIABLES = ("TORCH_NCCL_ENABLE_TIMING", "NCCL_ENABLE_TIMING")


def enable_nccl_timing() -> bool:
    """Set ``TORCH_NCCL_ENABLE_TIMING=1`` in this process unless the user set it (under either
    name, to any value: theirs is kept). True when this call set it."""
    if any(name in os.environ for name in NCCL_TIMING_VARIABLES):
        return False
    os.environ[NCCL_TIMING_VARIABLES[0]] = "1"
    return True


def init_process_group(backend: str, timeout: float, **rendezvous) -> None:
    """Join the group; an NCCL rank first binds its GPU and names it to the group, so no
    collective (the first barrier included) has to guess which GPU this rank uses, and turns
    on NCCL's own timing of each op (:func:`enable_nccl_timing`)."""
    device_id = None
    if backend == "nccl":
        enable_nccl_timing()
        device_id = local_gpu()
        torch.cuda.set_device(device_id)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout), device_id=device_id,
                            **rendezvous)
