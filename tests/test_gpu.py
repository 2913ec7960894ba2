"""GPU paths: NCCL at world size 1 (NCCL needs one GPU per rank) and Gloo on CUDA tensors.

Skipped, with the reason shown, on a machine without CUDA. `scripts/gpu_check.sh` runs these.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from engine import launch
from engine.observe.meter import CommMeter
from engine.comm import ops

pytestmark = pytest.mark.gpu


def _cuda_all_reduce(rank, world_size):
    device = torch.device("cuda", torch.cuda.current_device())
    t = torch.full((1024,), float(rank + 1), device=device)
    with CommMeter() as meter:
        ops.all_reduce(t)
    return t, dist.get_backend(), meter.bytes_sent


def test_nccl_world_size_1_runs_and_returns_cpu_tensors():
    [(t, backend, sent)] = launch(_cuda_all_reduce, 1, backend="nccl", timeout=120, quiet=True)
    assert backend == "nccl" and t.device.type == "cpu"
    assert torch.equal(t, torch.ones(1024)) and sent == 0  # a group of one moves nothing


def test_gloo_on_cuda_tensors_across_ranks_sharing_one_gpu():
    results = launch(_cuda_all_reduce, 2, backend="gloo", start_method="spawn", timeout=120,
                     quiet=True)
    for t, backend, sent in results:
        assert backend == "gloo" and torch.equal(t, torch.full((1024,), 3.0))
        assert sent == 4096  # 2(N-1)/N · 4096 B with N = 2


def test_nccl_with_more_ranks_than_gpus_suggests_gloo():
    too_many = torch.cuda.device_count() + 1
    with pytest.raises(ValueError, match="one GPU per rank.*Use backend='gloo'"):
        launch(_cuda_all_reduce, too_many, backend="nccl")


def test_engine_train_on_one_gpu_with_nccl(capsys):
    from engine.__main__ import main

    assert main(["train", "--world-size", "1", "--backend", "nccl", "--model", "small",
                 "--steps", "3", "--impl", "both"]) == 0
    out = capsys.readouterr().out
    assert "MFU" in out and "CUDA peak" in out and "engine / torch tokens/s" in out


def _tp_pp_on_cuda(rank, world_size):
    from engine.labs.hybrid import train_3d
    from engine.model.gpt import GPTConfig

    cfg = GPTConfig(vocab=64, seq_len=16, layers=2, heads=4, hidden=32)
    return train_3d(rank, world_size, 1, 1, 1, cfg, 2)["losses"]


def test_3d_trainer_at_world_size_1_on_nccl():
    [losses] = launch(_tp_pp_on_cuda, 1, backend="nccl", timeout=120, quiet=True)
    assert len(losses) == 2 and losses[1] < losses[0]


def _where_am_i(rank, world_size):
    from engine.launch.device import rank_device

    return str(rank_device()), torch.cuda.current_device(), dist.get_backend()


def test_an_nccl_rank_computes_on_the_gpu_it_was_bound_to():
    [(device, current, backend)] = launch(_where_am_i, 1, backend="nccl", timeout=120,
                                          quiet=True)
    assert (device, current, backend) == ("cuda:0", 0, "nccl")
