"""engine.comm.timing: its defaults run on the group's backend, NCCL included.

No GPU here: a rank on Gloo reports its backend as NCCL (``dist.get_backend``) and its GPU as
the CPU (``engine.launch.device.local_gpu``), so every NCCL-only path of the engine (the tuned ring's
refusal, ``nccl_rules``' checks, the rank's device) runs as it would on a GPU host.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from engine.comm import timing
from tests.helpers import run_ranks


def _as_if_on_nccl(fn, *args):
    from engine.launch import device as launch_device

    get_backend, local_gpu = dist.get_backend, launch_device.local_gpu
    dist.get_backend = lambda group=None: "nccl"
    launch_device.local_gpu = lambda index=None: torch.device("cpu")
    try:
        return fn(*args)
    except ValueError as e:
        return f"ValueError: {e}"
    finally:
        dist.get_backend, launch_device.local_gpu = get_backend, local_gpu


def _timed_on_nccl(rank, world_size, *names):
    """The algorithms timed with their defaults, or with ``names`` if given."""
    chosen = {"names": names} if names else {}
    return _as_if_on_nccl(lambda: [
        row[0] for row in timing.time_all_reduces(rank, world_size, [4096], repeats=1, **chosen)])


def test_the_default_algorithms_run_on_nccl():
    """The tuned ring refuses NCCL, even at world size 1: the defaults leave it out there."""
    for world_size in (1, 2):
        timed = run_ranks(_timed_on_nccl, world_size)
        assert timed == [["built-in", "ring", "tree", "ps"]] * world_size


def test_the_tuned_ring_asked_for_on_nccl_is_refused_by_name():
    [refused] = run_ranks(_timed_on_nccl, 1, "ring", "ring-tuned")
    assert refused.startswith("ValueError: 'ring-tuned' cannot run on NCCL")
    assert "('built-in', 'ring', 'tree', 'ps')" in refused


def _timed_on_gloo(rank, world_size):
    rows = timing.time_all_reduces(rank, world_size, [4096], repeats=1)
    return [name for name, *_ in rows], timing.default_algorithms()


def test_on_gloo_the_defaults_are_every_algorithm():
    for names, defaults in run_ranks(_timed_on_gloo, 2):
        assert names == list(timing.ALGORITHMS) and defaults == tuple(timing.ALGORITHMS)


def test_an_unknown_algorithm_is_named():
    with pytest.raises(ValueError, match=r"unknown algorithm\(s\) \['rings'\]"):
        timing.all_reduce_samples(0, 1, [4], ("rings",))
