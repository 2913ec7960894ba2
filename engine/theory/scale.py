"""Model size, compute and time at scale (chapters 07-08).

Part of :mod:`engine.theory`: pure formulas, each naming its source; sizes in bytes.
"""

from __future__ import annotations


def transformer_params(layers: int, hidden: int, vocab: int = 51200, seq_len: int = 2048
                       ) -> float:
    """Parameters of a GPT-style transformer (Narayanan et al., "Efficient large-scale language
    model training on GPU clusters using Megatron-LM", SC 2021, equation 2):
    ``12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))``. GPT-3 (l=96, h=12288): 174.6 B."""
    n_layers, h = layers, hidden
    return 12 * n_layers * h * h * (1 + 13 / (12 * h) + (vocab + seq_len) / (12 * n_layers * h))


def transformer_flops(batch: int, seq_len: int, layers: int, hidden: int, vocab: int = 51200,
                      recompute: bool = True) -> float:
    """Floating-point operations of one training step on ``batch`` sequences (same paper,
    equation 3): ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` with full activation recomputation
    (one extra forward pass); ``72 ...`` without it."""
    s, n_layers, h = seq_len, layers, hidden
    return (96 if recompute else 72) * batch * s * n_layers * h * h * (
        1 + s / (6 * h) + vocab / (16 * n_layers * h))


def training_days(tokens: float, params: float, gpus: int, flops_per_gpu: float,
                  recompute: bool = True) -> float:
    """End-to-end training time in days (same paper, equation 4): ``8 T P / (n X)`` seconds
    with recomputation (``6 T P / (n X)`` without), for ``T`` tokens, ``P`` parameters, ``n``
    GPUs each sustaining ``X`` FLOP/s. GPT-3: 300 B tokens on 1024 GPUs at 140 TFLOP/s, about
    34 days."""
    return (8 if recompute else 6) * tokens * params / (gpus * flops_per_gpu) / 86400


def tp_activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int,
                                  tp: int = 1, recompute: bool = False) -> float:
    """Activation bytes per transformer layer per GPU with tensor parallelism ``tp`` and no
    sequence parallelism (Korthikanti et al., MLSys 2023, equation 2 and section 4.2):
    ``s b h (10 + 24/t + 5 a s / (h t))``; with full recomputation only the layer input,
    ``2 s b h``."""
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    if recompute:
        return 2 * s * b * h
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
