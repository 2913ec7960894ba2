"""The roofline formulas (engine.theory.roofline) against what they claim: the FLOPs PyTorch
counts, the TP traffic formula the parity matrix checks against counted bytes, and the
balance points where compute and communication take the same time."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from engine import theory
from engine.theory.hardware import GPU_SPECS

H100 = GPU_SPECS["NVIDIA H100 80GB HBM3"]
F, HBM, NVLINK, NIC = H100.bf16_tflops * 1e12, H100.hbm_gbps * 1e9, H100.nvlink_gbps * 1e9, \
    H100.network_gbps * 1e9


def test_a_matrix_products_flops_are_what_pytorch_counts_and_its_intensity_follows():
    m, k, n = 48, 96, 80
    a, b = torch.randn(m, k), torch.randn(k, n)
    with FlopCounterMode(display=False) as counter:
        a @ b
    assert counter.get_total_flops() == 2 * m * k * n
    assert theory.matmul_intensity(m, k, n, 4) == 2 * m * k * n / (4 * (m * k + k * n + m * n))
    # a linear layer over few tokens: about T FLOPs a byte in bf16, far below the ridge
    assert 0.95 * 64 < theory.matmul_intensity(64, 4096, 4096) < 64  # 62.1: 2T/e, less


def test_the_h100s_ridge_and_roofline():
    ridge = theory.ridge_intensity(F, HBM)
    assert ridge == pytest.approx(295.2, abs=0.1)  # 989 TFLOP/s over 3.35 TB/s
    assert theory.attainable_flops(ridge / 2, F, HBM) == pytest.approx(F / 2)
    assert theory.attainable_flops(10 * ridge, F, HBM) == F


def test_every_gpu_of_the_table_has_its_memory_bandwidth_and_blackwell_is_there():
    assert all(gpu.hbm_gbps for gpu in GPU_SPECS.values())
    b200, gb200 = GPU_SPECS["NVIDIA B200"], GPU_SPECS["NVIDIA GB200"]
    assert (b200.bf16_tflops, b200.memory_gb, b200.hbm_gbps) == (2250, 180, 8000)
    assert (gb200.bf16_tflops, gb200.memory_gb, gb200.hbm_gbps) == (2500, 186, 8000)


@pytest.mark.parametrize("sharded, collectives", [(False, 2), (True, 3)])
def test_data_parallelism_balances_compute_and_traffic_at_its_minimum_batch(sharded, collectives):
    params = 8.03e9
    tokens = theory.dp_min_tokens_per_gpu(F, NIC, sharded=sharded)
    compute = 6 * params * tokens / F
    traffic = collectives * 2 * params / NIC  # bf16, each collective the parameters once
    assert compute == pytest.approx(traffic)
    assert tokens == pytest.approx((1 if sharded else 2 / 3) * F / NIC)


def test_tensor_parallelism_is_compute_bound_up_to_its_degree_and_sends_what_the_engine_counts():
    d, tokens = 4096, 8192
    t_max = theory.tp_max_degree(d, F, NVLINK)
    assert 9 < t_max < 10  # Llama 3 8B on H100 NVLink: one node of 8
    compute, comm = theory.tp_step_times(d, 8, tokens, F, NVLINK)
    assert compute > comm
    compute, comm = theory.tp_step_times(d, 16, tokens, F, NVLINK)
    assert compute < comm
    # the balance point itself (a real degree): compute = communication
    t = t_max
    compute = 72 * d * d * tokens / t / F
    comm = 8 * tokens * d * (t - 1) / t * 2 / NVLINK
    assert math.isclose(compute, comm)
    # the traffic is the formula the parity matrix holds to counted bytes
    _, comm8 = theory.tp_step_times(d, 8, tokens, F, NVLINK)
    assert comm8 * NVLINK == 2 * theory.tp_comm_elements_per_layer(1, tokens, d, 8)


def test_mfu():
    # 1,000 tokens/s of a model needing 6 GFLOPs a token on 2 GPUs of 6 TFLOP/s: 50%
    assert theory.mfu(1000, 6e9, 2, 6e12) == pytest.approx(0.5)
