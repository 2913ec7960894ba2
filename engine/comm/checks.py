"""Input checks shared by the collectives built from point-to-point sends.

Point-to-point sends do not check that both sides agree: a receive of 7 elements matched with a
send of 5 completes silently with garbage (measured on Gloo). So every collective here, by
default, first compares the tensor's size and dtype across the group with one tiny all-gather,
and raises the same clear ValueError on every rank. That check is not metered (it is not part
of the algorithm); pass ``check=False`` to skip it when timing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
                    torch.int64)
OPS = ("sum", "avg")


def normalize_op(op) -> str:
    """Accept "sum"/"avg" or ``dist.ReduceOp.SUM``/``AVG``; return "sum" or "avg"."""
    if op in (dist.ReduceOp.SUM, "sum"):
        return "sum"
    if op in (dist.ReduceOp.AVG, "avg"):
        return "avg"
    raise ValueError(f"op must be one of {OPS} (or dist.ReduceOp.SUM / AVG), got {op!r}")


def validate(t: torch.Tensor, op="sum", name: str = "tensor") -> str:
    """Check one rank's input; return the normalized op."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()} for shape "
                         f"{tuple(t.shape)}); call .contiguous() first")
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; supported: "
                         f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}")
    op = normalize_op(op)
    if op == "avg" and not t.is_floating_point():
        raise ValueError(f"op='avg' needs a floating-point tensor, got {t.dtype}")
    return op


def check_same_everywhere(t: torch.Tensor, group=None) -> None:
    """Raise on every rank if the ranks' tensors differ in element count or dtype."""
    n = dist.get_world_size(group)
    # NCCL takes only CUDA tensors; Gloo's all_gather only CPU ones
    device = t.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.tensor([t.numel(), SUPPORTED_DTYPES.index(t.dtype)], dtype=torch.int64,
                        device=device)
    everyone = [torch.empty(2, dtype=torch.int64, device=device) for _ in range(n)]
    dist.all_gather(everyone, mine, group=group)
    seen = [(int(e[0]), SUPPORTED_DTYPES[int(e[1])]) for e in everyone]
    if len(set(seen)) > 1:
        listing = ", ".join(f"rank {r}: {numel} x {dtype}" for r, (numel, dtype) in
                            enumerate(seen))
        raise ValueError(f"ranks hold different tensors for one collective ({listing}); every "
                         "rank must pass the same number of elements and the same dtype")
