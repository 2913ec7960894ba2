"""The GPUs the engine knows: peak FLOP/s, memory and link bandwidths, in one table.

The trainer's report reads the peaks for MFU (:func:`peak_flops`, by the exact name
``torch.cuda.get_device_name()`` gives: an H100 SXM, PCIe and NVL differ); the planner builds
its clusters from the same rows (:func:`cluster_specs`).

Peaks are dense TFLOP/s from NVIDIA's datasheets (the starred tensor-core figures are with
sparsity: halved here): bf16 on tensor cores, and fp32 without TF32 (torch leaves TF32 off for
matrix products by default). Bandwidths are GB/s per direction per GPU: NVLink inside a node,
one InfiniBand NIC per GPU between nodes (HDR 200 Gb/s = 25 GB/s, NDR 400 Gb/s = 50 GB/s);
None where the engine assumes none.
"""

from __future__ import annotations

from typing import NamedTuple


class GPU(NamedTuple):
    bf16_tflops: float
    fp32_tflops: float
    memory_gb: float
    nvlink_gbps: float | None = None
    network_gbps: float | None = None


GPU_SPECS = {
    "NVIDIA H100 80GB HBM3": GPU(989, 67, 80, 450, 50),  # H100 SXM5
    "NVIDIA H100 PCIe": GPU(756, 51, 80),
    "NVIDIA H100 NVL": GPU(835, 60, 94),
    "NVIDIA H200": GPU(989, 67, 141, 450, 50),  # H200 SXM
    "NVIDIA H200 NVL": GPU(835, 60, 141),
    "NVIDIA A100-SXM4-80GB": GPU(312, 19.5, 80, 300, 25),
    "NVIDIA A100-SXM4-40GB": GPU(312, 19.5, 40),
    "NVIDIA A100 80GB PCIe": GPU(312, 19.5, 80),
    "NVIDIA A100-PCIE-40GB": GPU(312, 19.5, 40),
    "NVIDIA L40S": GPU(362, 91.6, 48),
    "NVIDIA A10": GPU(125, 31.2, 24),
    "NVIDIA L4": GPU(121, 30.3, 24),
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
