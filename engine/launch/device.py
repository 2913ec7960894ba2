"""Which device a rank computes on, decided in one place.

* **NCCL**: the rank's own GPU, ``cuda:LOCAL_RANK``. NCCL moves only tensors that live on the
  GPU its communicator was built for, so every tensor handed to a collective must be there.
  :func:`engine.launch` binds each NCCL rank to that GPU (``torch.cuda.set_device`` and the
  process group's ``device_id``) before ``fn`` runs; torchrun sets ``LOCAL_RANK`` per process.
* **Gloo**: the CPU. Gloo also accepts CUDA tensors (several ranks sharing one GPU, see
  :mod:`engine.comm.ops`), but that is the caller's explicit choice, never a default: a CPU
  lesson stays on the CPU on any machine.

Nothing here asks CUDA anything on the Gloo path: a process that has called
``torch.cuda.is_available()`` can no longer fork ranks that use CUDA.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.launch.env import LaunchEnv


def local_rank() -> int:
    """This process's index among the ranks on its machine (``LOCAL_RANK``, else 0; read by
    :class:`engine.launch.env.LaunchEnv`)."""
    return LaunchEnv.read().local_rank


def local_gpu(index: int | None = None) -> torch.device:
    """The GPU an NCCL rank owns: ``cuda:LOCAL_RANK`` (or ``cuda:index``)."""
    return torch.device("cuda", local_rank() if index is None else index)


def rank_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device this rank computes on: its own GPU when ``group`` (default: the world) runs
    on NCCL, else the CPU. Outside a process group, the CPU."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return local_gpu()
    return torch.device("cpu")
