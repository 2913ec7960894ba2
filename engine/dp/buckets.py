"""Gradient buckets: which parameters share one all-reduce.

PyTorch DDP (Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", VLDB 2020, section 3.2) packs gradients into buckets of about ``bucket_cap_mb`` in
*reverse* parameter order: backward produces the last layer's gradients first, so the first
bucket fills first and its all-reduce can start while earlier layers are still computing.
"""

from __future__ import annotations

import torch


def assign_buckets(params: list[torch.nn.Parameter], cap_bytes: int,
                   first_cap_bytes: int | None = None) -> list[list[torch.nn.Parameter]]:
    """Group ``params`` (given in forward order) into buckets, last parameter first.

    A bucket is closed once it holds at least ``cap_bytes`` (the first one at
    ``first_cap_bytes``, if given); a parameter is never split across buckets.
    """
    buckets: list[list[torch.nn.Parameter]] = [[]]
    filled = 0
    for p in reversed(params):
        cap = first_cap_bytes if (first_cap_bytes and len(buckets) == 1) else cap_bytes
        if buckets[-1] and filled >= cap:
            buckets.append([])
            filled = 0
        buckets[-1].append(p)
        filled += p.numel() * p.element_size()
    return [b for b in buckets if b]
