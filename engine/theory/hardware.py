"""The GPUs the engine knows: peak FLOP/s, memory and link bandwidths, in one table.

The trainer's report reads the peaks for MFU (:func:`peak_flops`, by the exact name
``torch.cuda.get_device_name()`` gives: an H100 SXM, PCIe and NVL differ); the planner builds
its clusters from the same rows (:func:`cluster_specs`).

Peaks are dense TFLOP/s from NVIDIA's datasheets (the starred tensor-core figures are with
sparsity: halved here): bf16 on tensor cores, and fp32 without TF32 (torch leaves TF32 off for
matrix products by default). Bandwidths are GB/s per direction per GPU: NVLink inside a node,
one InfiniBand NIC per GPU between nodes (HDR 200 Gb/s = 25 GB/s, NDR 400 Gb/s = 50 GB/s);
None where the engine assumes none. ``hbm_gbps`` is the memory bandwidth of the datasheet (the
roofline's slope, :mod:`engine.theory.roofline`).

Blackwell (NVIDIA's Blackwell datasheets, 2024-25): an HGX B200 GPU at 1,000 W gives 2,250
dense bf16 TFLOP/s and 80 fp32, 180 GB of HBM3e at 8 TB/s; a GB200 NVL72 GPU at 1,200 W 2,500
and 90, 186 GB at 8 TB/s; NVLink 5 moves 1.8 TB/s both ways, 900 GB/s each.
"""

from __future__ import annotations

from typing import NamedTuple


class GPU(NamedTuple):
    bf16_tflops: float
    fp32_tflops: float
    memory_gb: float
    nvlink_gbps: float | None = None
    network_gbps: float | None = None
    hbm_gbps: float | None = None


GPU_SPECS = {
    "NVIDIA B200": GPU(2250, 80, 180, 900, 50, hbm_gbps=8000),  # HGX B200
    "NVIDIA GB200": GPU(2500, 90, 186, 900, 50, hbm_gbps=8000),  # GB200 NVL72
    "NVIDIA H100 80GB HBM3": GPU(989, 67, 80, 450, 50, hbm_gbps=3350),  # H100 SXM5
    "NVIDIA H100 PCIe": GPU(756, 51, 80, hbm_gbps=2000),
    "NVIDIA H100 NVL": GPU(835, 60, 94, hbm_gbps=3900),
    "NVIDIA H200": GPU(989, 67, 141, 450, 50, hbm_gbps=4800),  # H200 SXM
    "NVIDIA H200 NVL": GPU(835, 60, 141, hbm_gbps=4800),
    "NVIDIA A100-SXM4-80GB": GPU(312, 19.5, 80, 300, 25, hbm_gbps=2039),
    "NVIDIA A100-SXM4-40GB": GPU(312, 19.5, 40, hbm_gbps=1555),
    "NVIDIA A100 80GB PCIe": GPU(312, 19.5, 80, hbm_gbps=1935),
    "NVIDIA A100-PCIE-40GB": GPU(312, 19.5, 40, hbm_gbps=1555),
    "NVIDIA L40S": GPU(362, 91.6, 48, hbm_gbps=864),
    "NVIDIA A10": GPU(125, 31.2, 24, hbm_gbps=600),
    "NVIDIA L4": GPU(121, 30.3, 24, hbm_gbps=300),
}
# peak TFLOP/s by CUDA name and precision, as the report looks them up
PEAK_TFLOPS = {name: {"bf16": gpu.bf16_tflops, "fp32": gpu.fp32_tflops}
               for name, gpu in GPU_SPECS.items()}


def peak_flops(device: str, precision: str, override_tflops: float | None = None
               ) -> float | None:
    """Peak FLOP/s of one ``device`` (its exact CUDA name, or "CPU") in ``precision``;
    ``override_tflops`` wins; None where no peak is known (a CPU, an unlisted GPU)."""
    if override_tflops:
        return override_tflops * 1e12
    tflops = PEAK_TFLOPS.get(device, {}).get(precision)
    return tflops * 1e12 if tflops else None


def cluster_specs(device: str) -> dict[str, float]:
    """The :class:`engine.theory.planner.Cluster` settings of a node of ``device`` GPUs: memory, the
    bf16 peak, and the link bandwidths the table knows."""
    gpu = GPU_SPECS[device]
    links = {"intra_gbps": gpu.nvlink_gbps, "inter_gbps": gpu.network_gbps}
    return {"memory_gb": gpu.memory_gb, "peak_tflops": gpu.bf16_tflops,
            **{k: v for k, v in links.items() if v is not None}}
