"""Input checks shared by the collectives built from point-to-point sends.

Point-to-point sends do not check that both sides agree: a receive of 7 elements matched with a
send of 5 completes silently with garbage (measured on Gloo). So every collective here, by
default, first compares the tensor's size and dtype across the group with one tiny all-gather,
and raises the same clear ValueError on every rank. That check is not metered (it is not part
of the algorithm); pass ``check=False`` to skip it when timing.

:func:`agree` is that check for any list of integers, and :func:`gather_ints` the all-gather
under it: the pairwise all-to-all (:mod:`engine.comm.all_to_all`) and the context-parallel
attentions (:mod:`engine.cp.checks`) check their inputs with them too.
"""

from __future__ import annotations

from typing import Callable, Sequence

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


def gather_ints(values: Sequence[int], group=None, like: torch.Tensor | None = None
                ) -> list[tuple[int, ...]]:
    """Every rank's ``values`` (as many on every rank), in group order: one small all-gather,
    not metered (it checks an algorithm's inputs, it is not part of it).

    ``like``: a tensor of this rank's op, whose device the all-gather runs on under NCCL (NCCL
    takes only CUDA tensors; Gloo's all_gather only CPU ones).
    """
    n = dist.get_world_size(group)
    nccl = dist.get_backend(group) == "nccl" and like is not None
    device = like.device if nccl else torch.device("cpu")
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(everyone, mine, group=group)
    return [tuple(int(v) for v in e.tolist()) for e in everyone]


def agree(values: Sequence[int], group=None, like: torch.Tensor | None = None,
          describe: Callable[[list[tuple[int, ...]]], str] = str) -> list[tuple[int, ...]]:
    """The cross-rank agreement check: raise the same ValueError on every rank unless every
    rank passed the same ``values`` (sizes, dtype codes...); the message is
    ``describe(every rank's values)``. Returns every rank's values. A group of one rank agrees
    with itself: nothing is sent."""
    if dist.get_world_size(group) == 1:
        return [tuple(values)]
    seen = gather_ints(values, group, like)
    if len(set(seen)) > 1:
        raise ValueError(describe(seen))
    return seen


def check_same_everywhere(t: torch.Tensor, group=None) -> None:
    """Raise on every rank if the ranks' tensors differ in element count or dtype."""
    def listing(seen):
        ranks = ", ".join(f"rank {r}: {numel} x {SUPPORTED_DTYPES[dtype]}"
                          for r, (numel, dtype) in enumerate(seen))
        return (f"ranks hold different tensors for one collective ({ranks}); every rank must "
                "pass the same number of elements and the same dtype")

    agree([t.numel(), SUPPORTED_DTYPES.index(t.dtype)], group, t, listing)
