"""ZeRO (chapter 04).

Part of :mod:`engine.theory`: pure formulas, each naming its source; sizes in bytes.
"""

from __future__ import annotations

from engine.theory.collectives import check_n


def zero_model_state_bytes(psi: float, n: int, stage: int, k: float = 12,
                           param_bytes: float = 2, grad_bytes: float = 2) -> dict[str, float]:
    """Model-state bytes per device under ZeRO-DP stage 0-3 (Rajbhandari et al., "ZeRO:
    Memory optimizations toward training trillion parameter models", SC 2020, section 5.1 and
    Figure 1): ``param_bytes * psi`` of parameters, ``grad_bytes * psi`` of gradients and
    ``k * psi`` of optimizer state. Mixed-precision Adam is the paper's 2 + 2 + 12 (fp16
    parameters and gradients; fp32 master weights, momentum and variance); plain fp32 Adam is
    ``param_bytes=4, grad_bytes=4, k=8``. Stage 1 divides the optimizer state by ``n``, stage
    2 the gradients too, stage 3 the parameters too."""
    check_n(n)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    params, grads, optim = param_bytes * psi, grad_bytes * psi, k * psi
    if stage >= 1:
        optim /= n
    if stage >= 2:
        grads /= n
    if stage >= 3:
        params /= n
    return {"params": params, "grads": grads, "optimizer": optim,
            "total": params + grads + optim}


def zero_comm_elements(psi: float, n: int, stage: int) -> float:
    """Elements each rank sends per step (ZeRO paper, section 7): stages 0-2 move gradients
    and parameters once each, ``2(n-1)/n * psi`` (all-reduce, or reduce-scatter + all-gather);
    stage 3 gathers the parameters twice (forward and backward) and reduce-scatters the
    gradients, ``3(n-1)/n * psi``: 1.5x data parallelism."""
    check_n(n)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    return (3 if stage == 3 else 2) * (n - 1) / n * psi


def transformer_activation_bytes(layers: int, hidden: int, heads: int, seq_len: int,
                                 micro_batch: int = 1, checkpoint: bool = False) -> float:
    """Activation bytes one GPU keeps for backward, 16-bit activations, no tensor or sequence
    parallelism (Korthikanti et al., "Reducing activation recomputation in large transformer
    models", MLSys 2023, equation 1): ``s*b*h*(34 + 5*a*s/h)`` per layer. With full activation
    checkpointing only each layer's 16-bit input is kept: ``2*s*b*h`` per layer (section 5)."""
    s, b, h, a = seq_len, micro_batch, hidden, heads
    per_layer = 2 * s * b * h if checkpoint else s * b * h * (34 + 5 * a * s / h)
    return layers * per_layer


def offload_pcie_bytes(psi: float, n: int) -> float:
    """Bytes one GPU moves over PCIe per step under ZeRO-Offload (Ren et al., "ZeRO-Offload:
    Democratizing billion-scale model training", USENIX ATC 2021, section 4.1): its shard of
    the fp16 gradients down to the CPU's Adam (``2 psi / n``) and of the updated fp16
    parameters back up (``2 psi / n``): ``4 psi / n``."""
    check_n(n)
    return 2 * 2 * psi / n

