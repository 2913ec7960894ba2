"""The launch environment: who this process is among the ranks, read from one place.

torchrun (and :func:`engine.launch`, in each rank it starts) describes a rank through
environment variables: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``, and torchelastic's ``TORCHELASTIC_*``. This module is the
only one that reads (or, for a rank :func:`engine.launch` starts, writes) them:
:meth:`LaunchEnv.read` turns them into a frozen record, and the launcher, :mod:`engine.launch.device`,
:mod:`engine.launch.elastic` and ``engine train`` ask it instead of ``os.environ``.

The record is read when asked for, never cached: a forked rank inherits its parent's memory
but gets its own variables (:meth:`LaunchEnv.export`), and a test may set them. A caller reads
it once at its entry point and passes the record down.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

import torch.distributed as dist


@dataclass(frozen=True)
class LaunchEnv:
    """This process as its launcher described it.

    Each variable not set takes its value outside any launch: rank 0 of 1. ``LOCAL_WORLD_SIZE``
    unset (a scheduler that sets only ``RANK`` and ``WORLD_SIZE``) is taken as ``WORLD_SIZE``:
    every rank on this machine, the same answer on every process, so every process makes the
    same backend decision.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    under_torchrun: bool = False  # RANK and WORLD_SIZE set: this process is already one rank
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0  # how many times torchrun restarted the workers (elastic)
    max_restarts: int = 0  # torchrun --max-restarts
    agent_store_shared: bool = False  # the workers share torchrun's rendezvous store
    error_file: str | None = None  # where torchrun's agent reads a failed worker's error

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> LaunchEnv:
        """The record for ``environ`` (default: this process's environment, as it is now)."""
        env = os.environ if environ is None else environ
        world_size = _int(env, "WORLD_SIZE", 1)
        port = env.get("MASTER_PORT")
        return cls(
            rank=_int(env, "RANK", 0),
            world_size=world_size,
            local_rank=_int(env, "LOCAL_RANK", 0),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", world_size),
            under_torchrun="RANK" in env and "WORLD_SIZE" in env,
            master_addr=env.get("MASTER_ADDR"),
            master_port=int(port) if port else None,
            restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
            max_restarts=_int(env, "TORCHELASTIC_MAX_RESTARTS", 0),
            agent_store_shared=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            error_file=env.get("TORCHELASTIC_ERROR_FILE") or None,
        )

    def export(self) -> None:
        """Set this process's variables as torchrun would for this rank: what the rank's own
        code, and any process it starts, then read (a rank :func:`engine.launch` forked)."""
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
            LOCAL_WORLD_SIZE=str(self.local_world_size),
        )
        if self.master_addr is not None:
            os.environ["MASTER_ADDR"] = self.master_addr
        if self.master_port is not None:
            os.environ["MASTER_PORT"] = str(self.master_port)


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"the environment variable {name} must be an int, got {value!r}") \
            from None


def is_global_rank_zero() -> bool:
    """True in the one process that should print a report or write a file: global rank 0 of
    the process group, or of the launch that started this process (``RANK``, which torchrun
    and :func:`engine.launch` set), or a process that is no rank at all. It still answers after
    the process group is destroyed, so code that reports after ``launch`` returns can use it."""
    if dist.is_initialized():
        return dist.get_rank() == 0
    return LaunchEnv.read().rank == 0
