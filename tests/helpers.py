"""Helpers for tests that run code on several ranks."""

from __future__ import annotations

import os
import signal
from multiprocessing import resource_tracker
from pathlib import Path

import pytest
import torch

from engine import launch
from engine.grading.processes import descendants as engine_descendants

RANK_TIMEOUT_S = 30  # per launch; each test also has pytest-timeout's limit around it
CUDA_TIMEOUT_S = 180  # spawned ranks initialise CUDA first

# Where a strategy's equivalence test runs:
#   "cpu"         Gloo, CPU tensors, forked ranks;
#   "cpu-staged"  the same, with every op that Gloo cannot do on CUDA tensors sent through
#                 host copies, exactly as it is for CUDA tensors on Gloo: this machine tests
#                 the staging code that a one-GPU lab runs;
#   "cpu-nccl-rules" Gloo, CPU tensors, every op checked against NCCL's rules
#                 (engine.observe.nccl_rules): a tensor made without a device and handed to a
#                 collective, an any-source receive or a tag fails here as it would on NCCL;
#   "cuda"        NCCL, one GPU per rank, where there are enough GPUs; otherwise Gloo with
#                 CUDA tensors, every rank on GPU 0. Spawned ranks. Marked gpu: skipped, with
#                 the reason shown, where there is no GPU.
DEVICES = ("cpu", "cpu-staged", "cpu-nccl-rules", pytest.param("cuda", marks=pytest.mark.gpu))
BEYOND_CPU = DEVICES[1:]  # for a test whose CPU case a larger matrix already covers
# world sizes for those: one rank (NCCL on any GPU), and an odd three (Gloo with CUDA tensors on
# a one-GPU machine, NCCL on three GPUs or more)
DEVICE_WORLD_SIZES = (1, 3)


def run_ranks(fn, world_size: int, *args, timeout: float = RANK_TIMEOUT_S,
              device: str = "cpu"):
    """``fn(rank, world_size, *args)`` on ``world_size`` ranks set up for ``device`` (see
    ``DEVICES``); the results in rank order."""
    if device == "cpu":
        return launch(fn, world_size, *args, backend="gloo", timeout=timeout, quiet=True)
    if device == "cpu-staged":
        return launch(_with_host_staging, world_size, fn, *args, backend="gloo",
                      timeout=timeout, quiet=True)
    if device == "cpu-nccl-rules":
        return launch(_under_nccl_rules, world_size, fn, *args, backend="gloo",
                      timeout=timeout, quiet=True)
    if device != "cuda":
        raise ValueError(f"device={device!r}; expected one of 'cpu', 'cpu-staged', "
                         "'cpu-nccl-rules', 'cuda'")
    backend = "nccl" if world_size <= torch.cuda.device_count() else "gloo"
    return launch(fn, world_size, *args, backend=backend, start_method="spawn",
                  timeout=max(timeout, CUDA_TIMEOUT_S), quiet=True)


def rank_device(device: str) -> torch.device:
    """The device a rank computes on for ``device`` (see ``DEVICES``): under NCCL its own GPU,
    under Gloo with CUDA tensors GPU 0 (the current device of a rank that did not pick one)."""
    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _with_host_staging(rank, world_size, fn, *args):
    from engine.comm import p2p  # where staging is decided, for p2p ops and collectives alike

    p2p.stages_through_host = lambda tensor, group=None: True
    return fn(rank, world_size, *args)


def _under_nccl_rules(rank, world_size, fn, *args):
    from engine.observe.nccl_rules import nccl_rules

    with nccl_rules("cpu"):
        return fn(rank, world_size, *args)


def descendants(pid: int | None = None) -> list[int]:
    """Pids of every process below ``pid`` (default: this one), zombies included, from /proc
    (:func:`engine.grading.processes.descendants`).

    Python's own multiprocessing resource tracker (started once by any spawn) is not counted:
    it is a helper of this process that lives as long as it does, not a leftover rank.
    """
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    found = engine_descendants(os.getpid() if pid is None else pid)
    return [p for p in found if p != tracker]


def is_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


def default_sigint() -> None:
    """``preexec_fn`` for a child a test stops with SIGINT: SIGINT's default action, whatever
    this process inherited (a job started in the background by a non-interactive shell, as
    ``cmd &`` in a script, ignores SIGINT, and its children inherit that: a bash script cannot
    even trap it then, and Python raises no KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
