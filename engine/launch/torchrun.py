"""The torchrun path: the current process is already one rank, so ``fn`` runs here.

Under torchrun (``RANK`` and ``WORLD_SIZE`` set, :class:`engine.launch.env.LaunchEnv`) a lab
script's ``launch(fn, n)`` is the same code on one node or many: this process joins the group
torchrun set up (``env://``), runs ``fn`` once, and every rank gets every rank's result. Every
process makes the same backend decision: it depends on the arguments and on
``LOCAL_WORLD_SIZE``, never on ``LOCAL_RANK``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

from engine.launch.backend import init_process_group, resolve_backend
from engine.launch.env import LaunchEnv
from engine.launch.rank import to_cpu


def run_in_this_process(fn: Callable[..., Any], world_size: int, args: tuple, backend: str,
                        timeout: float, env: LaunchEnv) -> list[Any]:
    """``fn(env.rank, world_size, *args)`` here; every rank's result, in rank order. Joins the
    process group (and leaves it after) unless this process is already in one."""
    if world_size != env.world_size:
        raise ValueError(
            f"world_size={world_size} but this process was started with "
            f"WORLD_SIZE={env.world_size} (torchrun --nproc-per-node x --nnodes); "
            "pass the same number"
        )
    created = not dist.is_initialized()
    if created:
        # The same numbers on every process of a node, so every rank decides alike.
        backend = resolve_backend(backend, env.local_world_size, "LOCAL_WORLD_SIZE")
        init_process_group(backend, timeout)  # env:// rendezvous, as torchrun set it up
    try:
        result = to_cpu(fn(env.rank, world_size, *args))
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, result)
        return gathered
    finally:
        if created:
            dist.destroy_process_group()
