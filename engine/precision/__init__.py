"""Precision and memory: mixed precision with loss scaling, FP8 numerics, activation
recomputation measured (chapter 12).

The layers, bottom first::

    loss_scaler   DynamicLossScaler: GradScaler's decisions, from scratch
    mixed         fp32 masters + a bf16/fp16 working copy; fp16 underflow counted, and
                  fp16 without scaling stalling under SGD (underflow_experiment)
    fp8           quantize with per-tensor / per-row / DeepSeek-V3 tile scales; fp8_matmul;
                  scaling_grid (the activations' scaling under one weight scaling at a time)
    fp8_comm      an FP8 all-gather through engine.comm.ops (half of bf16's bytes), with one
                  scale per weight (torchao's) or per shard (this engine's variant)
    fp8_linear    Fp8Linear (E4M3 forward, E5M2 gradients: the hybrid recipe); the tiny GPT
                  trained in FP8
    recompute     activation checkpointing (none, full, selective, a memory budget): bytes
                  saved for backward and FLOPs counted (import engine.precision.recompute)
"""

from engine.precision.fp8 import (FORMATS, SCALINGS, TILE, dequantize, fp8_matmul,
                                  outlier_activations, quantize, relative_error,
                                  scaling_errors, scaling_grid, token_relative_error)
from engine.precision.fp8_comm import fp8_all_gather, fp8_cast, plain_all_gather
from engine.precision.fp8_linear import PRECISIONS, Fp8Linear, Fp8Matmul, to_fp8, train_lm
from engine.precision.loss_scaler import DynamicLossScaler
from engine.precision.mixed import (MixedRun, Underflow, bytes_per_parameter, gradient_underflow,
                                    held_bytes, small_mlp, train_mixed, underflow_experiment)

__all__ = ["DynamicLossScaler", "fp8_matmul", "quantize", "dequantize", "FORMATS", "SCALINGS",
           "TILE", "outlier_activations", "relative_error", "token_relative_error",
           "scaling_errors", "scaling_grid", "fp8_all_gather", "fp8_cast", "plain_all_gather",
           "Underflow", "bytes_per_parameter", "gradient_underflow", "small_mlp",
           "train_mixed", "MixedRun", "held_bytes", "Fp8Linear", "Fp8Matmul", "to_fp8",
           "train_lm", "PRECISIONS", "underflow_experiment"]
