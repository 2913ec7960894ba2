"""Exercise ch03.powersgd_step: one PowerSGD step on one gradient matrix, with error feedback.

PowerSGD (Vogels, Karimireddy & Jaggi, NeurIPS 2019, Algorithms 1 and 2) sends a rank-r
approximation of each n x m gradient matrix: two thin matrices, n x r and m x r, instead of
n x m numbers. Because both are linear in the gradient, all-reducing them gives the
approximation of the *average* gradient without ever sending it.

Fill in ``powersgd_step``, save, then run ``check("ch03.powersgd_step")`` in
course/03_compression.ipynb (or ``make grade``). The checks run it for 3 steps at 2 and 3
ranks on matrices of several shapes and ranks r, and compare what it returns, the new Q and
the new error with the engine's ``PowerSGD`` (``start_iter=0``) on the same gradients; then
they read the meter: (n + m) r numbers per step, never the n x m matrix.
"""

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)

from engine.comm import ops  # noqa: F401  (all-reduce through ops, so the meter sees it)
from engine.compress.powersgd import orthogonalize  # noqa: F401  (Gram-Schmidt, in place)


def powersgd_step(grad: torch.Tensor, q: torch.Tensor, error: torch.Tensor,
                  group=None) -> torch.Tensor:
    """One step for one gradient matrix; returns the n x m rank-r approximation of the
    average over ranks, the same on every rank.

    ``grad``: this rank's n x m gradient (leave it unchanged). ``q``: m x r, orthonormal
    columns (last step's Q, the warm start): overwrite it with this step's Q. ``error``:
    n x m, what earlier steps did not send: overwrite it with what this step does not send.

    1. M = grad + error (error feedback: nothing is lost, only delayed);
    2. P = M Q, all-reduce P (sum), then orthogonalize P's columns;
    3. Q = Mᵀ P, all-reduce Q and divide it by the number of ranks;
    4. the approximation is P Qᵀ; the new error is M minus it.
    """
    raise NotImplementedError("ch03.powersgd_step: write me")
