"""Gradient compression (chapter 03).

Part of :mod:`engine.theory`: pure formulas, each naming its source; sizes in bytes.
"""

from __future__ import annotations

import math

from engine.theory.collectives import check_n, ring_all_gather_bytes


def topk_kept(numel: int, ratio: float) -> int:
    """Coordinates Top-K keeps of a ``numel`` bucket: ``ceil(ratio * numel)``, at least 1."""
    return max(1, math.ceil(ratio * numel))


def topk_bytes_per_rank(numel: int, ratio: float, n: int, value_bytes: int = 4,
                        index_bytes: int = 4) -> float:
    """Bytes each rank sends for a Top-K exchange by ring all-gather of (values, indices):
    ``(n-1) * k * (value_bytes + index_bytes)``. Unlike a dense all-reduce's
    ``2(n-1)/n * S`` it grows with n, because every rank must receive every other rank's
    choice (Shi et al., "A distributed synchronous SGD algorithm with global Top-k
    sparsification", ICDCS 2019, section III)."""
    check_n(n)
    return ring_all_gather_bytes(n * topk_kept(numel, ratio) * (value_bytes + index_bytes), n)


def powersgd_elements(shapes, rank: int, min_compression_rate: float = 2) -> tuple[int, int]:
    """``(before, after)``: elements a dense all-reduce would send for gradients of ``shapes``,
    and what PowerSGD sends: ``(n + m) * r`` for each n x m matrix worth compressing, every
    element of the others (Vogels et al., NeurIPS 2019, section 3; PyTorch's rule for "worth
    it": ``(n + m) * r * min_compression_rate < n * m``)."""
    before = after = 0
    for shape in shapes:
        n = shape[0] if len(shape) else 1
        m = math.prod(shape) // n if n else 0
        r = min(n, m, rank)
        before += n * m
        worth = (n + m) * r * min_compression_rate < n * m
        after += (n + m) * r if worth else n * m
    return before, after


def topk_breakeven_ratio(n: int, value_bytes: int = 4, index_bytes: int = 4) -> float:
    """The Top-K ratio ``k/numel`` above which gathering values and indices
    (:func:`topk_bytes_per_rank`: ``(n-1) k (value + index)`` bytes a rank) sends more than a
    dense ring all-reduce of the fp32 gradient (``2(n-1)/n * 4 numel``): ``8 / (n (value +
    index))``, ``1/n`` for fp32 values and int32 indices (Aji & Heafield 2017's Top-K; the
    all-gather exchange of Renggli et al., SparCML, SC 2019)."""
    check_n(n)
    return 2 * 4 / (n * (value_bytes + index_bytes))

