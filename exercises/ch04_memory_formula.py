"""Exercise ch04.memory_formula: model-state bytes per GPU under ZeRO.

Fill in ``bytes_per_gpu``, save, then run ``check("ch04.memory_formula")`` in
course/04_zero.ipynb (or ``make grade``). It is checked on configurations you do not see.
"""


def bytes_per_gpu(psi: float, n: int, stage: int, precision: str = "mixed") -> float:
    """Bytes of parameters + gradients + optimizer state that one GPU holds, for ``psi``
    parameters trained with Adam over ``n`` data-parallel GPUs at ZeRO ``stage`` (0-3).

    ``precision="mixed"``: fp16/bf16 parameters and gradients (2 + 2 bytes) and fp32 master
    weights, momentum and variance (K = 12 bytes), as in the ZeRO paper.
    ``precision="fp32"``: 4-byte parameters and gradients, and Adam's two 4-byte moments.

    Stage 1 shards the optimizer state over the n GPUs, stage 2 the gradients too, stage 3 the
    parameters too.
    """
    raise NotImplementedError("ch04.memory_formula: write me")
