"""Exercise ch12.newton_schulz: Muon's quintic Newton-Schulz iteration.

Fill in ``newton_schulz``, save, then run ``check("ch12.newton_schulz")`` in
course/12_precision_memory.ipynb (or ``make grade``). It is checked on matrices you do not
see (wide, tall, square, of very large and very small norm) against Muon's iteration, on the
singular values it produces, and on the matmul FLOPs it spends (counted with PyTorch's
FlopCounterMode).
"""

import torch  # noqa: F401  (you will need it)

COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's (a, b, c)


def newton_schulz(g, steps=5):
    """An approximately orthogonal matrix with the singular vectors of ``g`` (2-D), in fp32.

    1. If ``g`` has more rows than columns, work on its transpose (so that ``X X^T`` is the
       smaller Gram matrix) and transpose the result back at the end.
    2. Normalise: ``X = g / (||g||_F + 1e-7)`` (the Frobenius norm bounds the spectral norm,
       so every singular value is then at most 1).
    3. ``steps`` times: ``A = X X^T``; ``X = a X + (b A + c A A) X``.
    """
    raise NotImplementedError("ch12.newton_schulz: write me")
