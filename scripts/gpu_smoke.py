"""The smoke checks that ``scripts/gpu_check.sh`` runs on a GPU machine, one per command.

    python scripts/gpu_smoke.py cpu-lesson      # a notebook-style launch on a GPU host: Gloo
    python scripts/gpu_smoke.py forked-cuda     # forked Gloo ranks using CUDA: works or says why
    python scripts/gpu_smoke.py gloo-cuda-3     # Gloo with CUDA tensors, 3 ranks on one GPU
    python scripts/gpu_smoke.py nccl-1          # NCCL at world size 1
    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        scripts/gpu_smoke.py torchrun            # more processes than GPUs: one backend, or a
                                                 # clear error on every rank for NCCL

Each check raises on anything unexpected and ends with one ``RESULT:`` line saying what it saw,
which the shell script copies into its summary. ``cpu-lesson`` and ``torchrun`` also run, and
are tested, on a machine without a GPU.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from engine import RankError, launch
from engine.launch.device import rank_device
from engine.launch import is_global_rank_zero


def result(text: str) -> None:
    print(f"RESULT: {text}", flush=True)


# -- a CPU lesson on a GPU host ----------------------------------------------------------------


def cpu_lesson() -> None:
    """What a notebook does: ask about CUDA, then launch a closure with the default backend."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    offset = 1.0

    def lesson(rank, world_size):  # a closure, as a notebook cell defines it: fork only
        t = torch.full((4,), rank + offset)
        dist.all_reduce(t)
        return dist.get_backend(), t.device.type, float(t[0]), str(rank_device())

    results = launch(lesson, 2, timeout=60, quiet=True)
    assert results == [("gloo", "cpu", 3.0, "cpu")] * 2, results
    result(f"a notebook-style launch with {gpus} GPU(s) visible ran on Gloo with CPU tensors")


# -- forked Gloo ranks that use CUDA -----------------------------------------------------------


def _touch_cuda(rank, world_size):
    t = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(t)  # Gloo takes CUDA tensors in all-reduce
    return float(t[0]), t.device.type


def _forked_outcome() -> str:
    try:
        results = launch(_touch_cuda, 2, backend="gloo", start_method="fork", timeout=60,
                         quiet=True)
    except RankError as e:
        if "start_method='spawn'" not in str(e):
            raise  # an error, but not the one that says what to do
        return "a clear error (use start_method='spawn')"
    assert results == [(3.0, "cuda")] * 2, results
    return "works"


def forked_cuda() -> None:
    """First from a parent that has not touched CUDA, then from one that asked is_available()."""
    untouched = _forked_outcome()
    assert torch.cuda.is_available(), "this check needs a CUDA GPU"
    asked = _forked_outcome()
    result(f"forked Gloo ranks using CUDA: parent untouched -> {untouched}; "
           f"after torch.cuda.is_available() -> {asked}")


# -- Gloo with CUDA tensors, several ranks on one GPU -----------------------------------------


def _gloo_cuda(rank, world_size):
    from engine.comm import ring_all_reduce

    device = torch.device("cuda", 0)
    built_in = torch.full((1000,), float(rank + 1), device=device)
    dist.all_reduce(built_in)  # Gloo's own, on CUDA tensors
    ring = torch.full((999,), float(rank + 1), device=device)  # 999: uneven chunks over 3
    ring_all_reduce(ring)  # the engine's ring: p2p on CUDA tensors goes through host copies
    return dist.get_backend(), ring.device.type, float(built_in[0]), float(ring.min()), \
        float(ring.max())


def gloo_cuda_3() -> None:
    results = launch(_gloo_cuda, 3, backend="gloo", start_method="spawn", timeout=120,
                     quiet=True)
    assert results == [("gloo", "cuda", 6.0, 6.0, 6.0)] * 3, results
    result("Gloo with CUDA tensors on 3 ranks sharing GPU 0: built-in and ring all-reduce agree")


# -- NCCL at world size 1 ----------------------------------------------------------------------


def _nccl_one(rank, world_size):
    from engine.comm import ring_all_reduce

    device = rank_device()
    t = torch.arange(8.0, device=device)
    dist.all_reduce(t)
    ring_all_reduce(t)
    return dist.get_backend(), str(device), torch.cuda.current_device(), t.tolist()


def nccl_1() -> None:
    [(backend, device, current, values)] = launch(_nccl_one, 1, backend="nccl", timeout=120,
                                                  quiet=True)
    assert (backend, device, current) == ("nccl", "cuda:0", 0), (backend, device, current)
    assert values == [float(i) for i in range(8)], values
    result("NCCL at world size 1: rank on cuda:0, built-in and ring all-reduce run")


# -- torchrun with more processes than GPUs ----------------------------------------------------


def _backend(rank, world_size):
    t = torch.ones(1, device=rank_device())  # NCCL moves only tensors on the rank's GPU
    dist.all_reduce(t)
    return dist.get_backend(), float(t)


def torchrun() -> None:
    """Run under ``torchrun --nproc-per-node N``: NCCL is refused on every rank when there are
    fewer GPUs than N (else used), and the default backend is Gloo on every rank."""
    world_size = int(os.environ["WORLD_SIZE"])
    ranks_here = int(os.environ["LOCAL_WORLD_SIZE"])
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < ranks_here:
        try:
            launch(_backend, world_size, backend="nccl", timeout=60)
        except ValueError as e:
            assert "GPU" in str(e) and "backend='gloo'" in str(e), e
            nccl = f"refused on every rank ({e})"
        else:
            raise AssertionError("NCCL accepted with fewer GPUs than ranks")
    else:
        assert launch(_backend, world_size, backend="nccl", timeout=60) == \
            [("nccl", float(world_size))] * world_size
        nccl = "ran"
    results = launch(_backend, world_size, timeout=60)
    assert results == [("gloo", float(world_size))] * world_size, results
    if is_global_rank_zero():
        result(f"torchrun, {ranks_here} processes, {gpus} GPU(s): default -> Gloo on every "
               f"rank; NCCL {nccl}")


CHECKS = {"cpu-lesson": cpu_lesson, "forked-cuda": forked_cuda, "gloo-cuda-3": gloo_cuda_3,
          "nccl-1": nccl_1, "torchrun": torchrun}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in CHECKS:
        sys.exit(f"usage: python scripts/gpu_smoke.py {{{'|'.join(CHECKS)}}}")
    CHECKS[sys.argv[1]]()
