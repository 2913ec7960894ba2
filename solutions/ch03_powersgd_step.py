"""Reference for exercise ch03.powersgd_step (the engine's, for whole buckets, is
engine/compress/powersgd.py)."""

import torch
import torch.distributed as dist

from engine.comm import ops
from engine.compress.powersgd import orthogonalize


def powersgd_step(grad: torch.Tensor, q: torch.Tensor, error: torch.Tensor,
                  group=None) -> torch.Tensor:
    """P = M Q, all-reduce, orthogonalize; Q = Mᵀ P, all-reduce, / N; approx = P Qᵀ."""
    matrix = grad + error
    p = matrix @ q
    ops.all_reduce(p, group=group)
    orthogonalize(p)
    torch.matmul(matrix.t(), p, out=q)
    ops.all_reduce(q, group=group)
    q.div_(dist.get_world_size(group))
    approx = p @ q.t()
    error.copy_(matrix - approx)
    return approx
