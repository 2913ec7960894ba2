"""Rooflines: when a GPU computes at its peak, and when a parallelism's communication, not its
arithmetic, sets the step time (chapter 13).

**One GPU** (Williams, Waterman and Patterson, "Roofline", CACM 2009): a kernel doing ``F``
FLOPs on ``Q`` bytes of memory traffic has arithmetic intensity ``I = F / Q`` and runs at
most at ``min(peak, I * bandwidth)``; below the ridge ``I* = peak / bandwidth`` it waits for
memory. A matrix product ``[m, k] @ [k, n]`` does ``2mkn`` FLOPs on ``e(mk + kn + mn)``
bytes: for a linear layer over ``T`` tokens with ``T`` far below its widths, ``I`` is about
``2T / e``, ``T`` in bf16. An H100 SXM's ridge in bf16 is 989e12 / 3.35e12 = 295 FLOPs a
byte: a layer needs a few hundred tokens at once before its matrix product is compute-bound.

**Many GPUs** (the conditions of Austin et al., "How to Scale Your Model", 2025, derived here
for ring collectives, with ``F`` the FLOP/s and ``W`` the link's bytes per second each way,
every collective overlapped with compute, and a training step's ``6`` FLOPs per parameter per
token, Kaplan et al. 2020): a step is communication-bound when its collectives take longer
than its arithmetic.

* Data parallelism all-reduces every gradient, ``2eP`` bytes sent per GPU, against
  ``6PT / F`` seconds of compute for ``T`` tokens per GPU: compute-bound when
  ``T >= (e/3) F/W`` tokens per GPU and step. ZeRO-3 (FSDP) sends ``3eP`` (two all-gathers,
  one reduce-scatter): ``T >= (e/2) F/W``.
* Megatron tensor parallelism over ``t`` GPUs sends ``8 d (t-1)/t`` elements per token and
  layer (:func:`engine.theory.tp_comm_elements_per_layer`) against ``6 * 12 d^2 / t`` FLOPs:
  compute-bound while ``d >= (e/9)(t - 1) F/W``, so ``t <= 1 + 9 d W / (e F)``. On H100
  NVLink (``F/W = 2,198`` in bf16) Llama 3 8B's ``d = 4,096`` allows ``t`` up to 9: one node.

Pure: numbers in, numbers out.
"""

from __future__ import annotations

from engine.theory.collectives import check_n

TRAIN_FLOPS_PER_PARAM_TOKEN = 6  # forward 2, backward 4 (Kaplan et al. 2020)


def matmul_intensity(m: int, k: int, n: int, bytes_per_element: int = 2) -> float:
    """FLOPs per byte of ``[m, k] @ [k, n]``: ``2mkn / (e(mk + kn + mn))``, each operand read
    and the result written once."""
    return 2 * m * k * n / (bytes_per_element * (m * k + k * n + m * n))


def ridge_intensity(peak_flops: float, memory_bytes_per_s: float) -> float:
    """The roofline's ridge, FLOPs per byte: below it a kernel waits for memory."""
    return peak_flops / memory_bytes_per_s


def attainable_flops(intensity: float, peak_flops: float, memory_bytes_per_s: float) -> float:
    """The roofline: ``min(peak, intensity * bandwidth)`` FLOP/s."""
    return min(peak_flops, intensity * memory_bytes_per_s)


def dp_min_tokens_per_gpu(peak_flops: float, link_bytes_per_s: float,
                          bytes_per_element: int = 2, sharded: bool = False) -> float:
    """The fewest tokens per GPU and step for which data parallelism's gradient traffic hides
    behind the step's compute: ``(e/3) F/W`` (all-reduce), ``(e/2) F/W`` for ZeRO-3
    (``sharded``: three collectives of the parameters instead of an all-reduce's two)."""
    sent_per_param = (3 if sharded else 2) * bytes_per_element
    return sent_per_param / TRAIN_FLOPS_PER_PARAM_TOKEN * peak_flops / link_bytes_per_s


def tp_max_degree(hidden: int, peak_flops: float, link_bytes_per_s: float,
                  bytes_per_element: int = 2) -> float:
    """The largest tensor-parallel degree whose activation traffic hides behind its matrix
    products, a real number: ``1 + 9 d W / (e F)`` (module docstring)."""
    return 1 + 9 * hidden * link_bytes_per_s / (bytes_per_element * peak_flops)


def tp_step_times(hidden: int, t: int, tokens: int, peak_flops: float,
                  link_bytes_per_s: float, bytes_per_element: int = 2) -> tuple[float, float]:
    """``(compute, communication)`` seconds of one layer over ``tokens`` tokens (forward and
    backward) on one of ``t`` tensor-parallel GPUs: ``72 d^2 T / (t F)`` and ``8 d T (t-1)/t``
    elements of ``e`` bytes over ``W``."""
    check_n(t)
    compute = 6 * 12 * hidden * hidden * tokens / t / peak_flops
    sent = 8 * tokens * hidden * (t - 1) / t * bytes_per_element
    return compute, sent / link_bytes_per_s


def mfu(tokens_per_s: float, flops_per_token: float, gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilisation (Chowdhery et al., PaLM, 2022, appendix B): the FLOPs the model
    needs per token (no recomputation counted) times tokens a second, over the GPUs' peak.
    Hardware FLOPs utilisation (HFU) counts the recomputed forward too."""
    return tokens_per_s * flops_per_token / (gpus * peak_flops)
