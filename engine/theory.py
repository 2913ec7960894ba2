"""Pure formulas the course checks against measurements. No ``torch.distributed`` in here.

Each function names its source. Sizes are in bytes; ``n`` is the number of ranks in the group.

Communication volume of ring collectives (Patarasuk & Yuan, "Bandwidth optimal all-reduce
algorithms for clusters of workstations", JPDC 2009; the same factors nccl-tests uses for bus
bandwidth, see its doc/PERFORMANCE.md):

* reduce-scatter and all-gather: each rank sends and receives ``(n-1)/n * S``
  (``S`` = the size of the full, unsharded tensor);
* all-reduce = reduce-scatter + all-gather: ``2(n-1)/n * S`` each way per rank;
* broadcast as a pipelined chain: every rank but the root receives ``S``; every rank but the
  last in the chain forwards ``S``.
"""

from __future__ import annotations


def _check_n(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (number of ranks) must be an int >= 1, got {n!r}")


def ring_all_reduce_bytes(size_bytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``size_bytes``: 2(n-1)/n·S."""
    _check_n(n)
    return 2 * (n - 1) / n * size_bytes


def ring_reduce_scatter_bytes(size_bytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring reduce-scatter of a ``size_bytes`` input."""
    _check_n(n)
    return (n - 1) / n * size_bytes


def ring_all_gather_bytes(size_bytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-gather into a ``size_bytes`` output."""
    _check_n(n)
    return (n - 1) / n * size_bytes


def chain_broadcast_bytes(
    size_bytes: float, n: int, rank: int, root: int = 0
) -> tuple[float, float]:
    """``(sent, received)`` by ``rank`` in a pipelined chain broadcast from ``root``."""
    _check_n(n)
    position = (rank - root) % n  # 0 is the root, n-1 the end of the chain
    sent = size_bytes if position < n - 1 else 0
    received = size_bytes if position > 0 else 0
    return sent, received


def flat_broadcast_bytes(
    size_bytes: float, n: int, rank: int, root: int = 0
) -> tuple[float, float]:
    """``(sent, received)`` when the root sends the whole tensor to each peer in turn."""
    _check_n(n)
    if rank == root:
        return (n - 1) * size_bytes, 0
    return 0, size_bytes


def collective_wire_bytes(
    op: str, size_bytes: int, n: int, rank: int, root: int = 0
) -> tuple[int, int]:
    """The wire model :class:`engine.comm.CommMeter` uses for built-in collectives.

    Returns ``(sent, received)`` for ``rank`` under the bandwidth-optimal ring/chain algorithm.
    ``size_bytes`` is the full tensor: the all-reduce buffer, the reduce-scatter input, the
    all-gather output or the broadcast buffer.
    """
    if op == "all_reduce":
        b = ring_all_reduce_bytes(size_bytes, n)
        sent = received = b
    elif op == "reduce_scatter":
        sent = received = ring_reduce_scatter_bytes(size_bytes, n)
    elif op == "all_gather":
        sent = received = ring_all_gather_bytes(size_bytes, n)
    elif op == "broadcast":
        sent, received = chain_broadcast_bytes(size_bytes, n, rank, root)
    elif op == "reduce":  # a broadcast run backwards: data flows down the chain to the root
        received, sent = chain_broadcast_bytes(size_bytes, n, rank, root)
    elif op == "barrier":
        sent = received = 0
    else:
        raise ValueError(
            f"no wire model for op {op!r}; expected one of all_reduce, reduce_scatter, "
            "all_gather, broadcast, reduce, barrier"
        )
    return round(sent), round(received)
