"""Communication volume and time of the collectives (chapters 01-02).

Part of :mod:`engine.theory`: pure formulas, each naming its source; sizes in bytes.
"""

from __future__ import annotations

import math

from engine.validation import positive_int


def check_n(n: int) -> None:
    """``n`` (a number of ranks) must be a positive int."""
    positive_int("n (number of ranks)", n)


def ring_all_reduce_bytes(size_bytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``size_bytes``: 2(n-1)/n·S."""
    check_n(n)
    return 2 * (n - 1) / n * size_bytes


def ring_all_reduce_rank_bytes(numel: int, element_bytes: int, n: int, index: int) -> int:
    """Bytes the rank at ``index`` of the ring sends in a ring all-reduce of ``numel``
    elements cut into ``n`` chunks (the first ``numel mod n`` one element longer): in the
    reduce-scatter it sends every chunk but its own (``index``), in the all-gather every chunk
    but the one its left neighbour finished (``index + 1``). The mean over the ranks is
    :func:`ring_all_reduce_bytes`; a rank's own differs when ``n`` does not divide ``numel``
    (a scalar over 4 ranks: 4, 8, 8, 4 B, not 6 B each)."""
    check_n(n)
    q, r = divmod(numel, n)
    chunk = [q + (1 if i < r else 0) for i in range(n)]
    return element_bytes * (2 * numel - chunk[index % n] - chunk[(index + 1) % n]) \
        if n > 1 else 0


def ring_reduce_scatter_bytes(size_bytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring reduce-scatter of a ``size_bytes`` input."""
    check_n(n)
    return (n - 1) / n * size_bytes


def ring_all_gather_bytes(size_bytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-gather into a ``size_bytes`` output."""
    check_n(n)
    return (n - 1) / n * size_bytes


def chain_broadcast_bytes(
    size_bytes: float, n: int, rank: int, root: int = 0
) -> tuple[float, float]:
    """``(sent, received)`` by ``rank`` in a pipelined chain broadcast from ``root``."""
    check_n(n)
    position = (rank - root) % n  # 0 is the root, n-1 the end of the chain
    sent = size_bytes if position < n - 1 else 0
    received = size_bytes if position > 0 else 0
    return sent, received


def all_to_all_bytes(size_bytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in an all-to-all of ``size_bytes`` split evenly:
    (n-1)/n·S. A rank keeps the 1/n addressed to itself and sends every other piece once
    (pairwise exchange; the collective of expert and Ulysses parallelism)."""
    check_n(n)
    return (n - 1) / n * size_bytes


def flat_broadcast_bytes(
    size_bytes: float, n: int, rank: int, root: int = 0
) -> tuple[float, float]:
    """``(sent, received)`` when the root sends the whole tensor to each peer in turn."""
    check_n(n)
    if rank == root:
        return (n - 1) * size_bytes, 0
    return 0, size_bytes


def collective_wire_bytes(
    op: str, size_bytes: int, n: int, rank: int, root: int = 0
) -> tuple[int, int]:
    """The wire model :class:`engine.observe.meter.CommMeter` uses for built-in collectives.

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


def ps_all_reduce_bytes(size_bytes: float, n: int) -> dict[str, float]:
    """Traffic of an all-reduce through a parameter server that is one of the ``n`` ranks.

    Returns ``{"worker_sent", "worker_received", "server_sent", "server_received"}``: a worker
    moves S each way, the server (n-1)·S each way (Li et al., OSDI 2014). Summed over all
    ranks both the PS and the ring send 2(n-1)·S; the difference is where: the ring spreads it
    evenly, 2(n-1)/n·S per rank, while the server's link carries n-1 times a worker's share.
    """
    check_n(n)
    worker = size_bytes if n > 1 else 0
    return dict(worker_sent=worker, worker_received=worker,
                server_sent=(n - 1) * size_bytes, server_received=(n - 1) * size_bytes)


def tree_all_reduce_bytes(size_bytes: float, n: int, rank: int) -> tuple[float, float]:
    """``(sent, received)`` by ``rank`` (index in the group) in a binomial-tree all-reduce.

    Each tree edge carries S up (reduce) and S down (broadcast); a rank sends S·(children + 1)
    and receives as much, except the root, which has no parent (engine.comm.tree).
    """
    check_n(n)
    children, mask = 0, 1
    while mask < n and not rank % (2 * mask):
        children += rank + mask < n
        mask *= 2
    edges = children + (1 if rank else 0)
    return edges * size_bytes, edges * size_bytes


def all_reduce_steps(algorithm: str, n: int) -> int:
    """Sequential message rounds on the critical path: the alpha (latency) term's count."""
    check_n(n)
    rounds = {"ring": 2 * (n - 1), "ps": 2 * (n - 1),
              "tree": 2 * math.ceil(math.log2(n)) if n > 1 else 0}
    if algorithm not in rounds:
        raise ValueError(f"algorithm must be one of {tuple(rounds)}, got {algorithm!r}")
    return rounds[algorithm]


def all_reduce_critical_bytes(algorithm: str, size_bytes: float, n: int) -> float:
    """Bytes crossing the busiest link in sequence: the beta (bandwidth) term's count.

    ring: 2(n-1)/n·S; tree: S per round, 2·ceil(log2 n) rounds; parameter server: the
    server's link carries (n-1)·S in and (n-1)·S out, one message after another.
    """
    if algorithm == "ring":
        return ring_all_reduce_bytes(size_bytes, n)
    if algorithm == "tree":
        return all_reduce_steps("tree", n) * size_bytes
    if algorithm == "ps":
        return 2 * (n - 1) * size_bytes
    raise ValueError(f"algorithm must be one of ('ring', 'tree', 'ps'), got {algorithm!r}")


def alpha_beta_time(algorithm: str, size_bytes: float, n: int, alpha: float, beta: float) -> float:
    """Predicted seconds: alpha·steps + beta·critical bytes (Hockney's model; Thakur,
    Rabenseifner & Gropp, "Optimization of collective communication operations in MPICH",
    IJHPCA 2005). ``alpha`` in seconds per message, ``beta`` in seconds per byte."""
    return (alpha * all_reduce_steps(algorithm, n)
            + beta * all_reduce_critical_bytes(algorithm, size_bytes, n))


def fit_alpha_beta(samples) -> tuple[float, float]:
    """Least-squares ``(alpha, beta)`` from ``[(algorithm, size_bytes, n, seconds), ...]``."""
    rows, times = [], []
    for algorithm, size, n, seconds in samples:
        rows.append((all_reduce_steps(algorithm, n),
                     all_reduce_critical_bytes(algorithm, size, n)))
        times.append(seconds)
    if len(rows) < 2:
        raise ValueError(f"need at least 2 samples to fit alpha and beta, got {len(rows)}")
    import numpy as np

    a, y = np.array(rows, float), np.array(times, float)
    (alpha, beta), *_ = np.linalg.lstsq(a, y, rcond=None)
    if alpha < 0:  # noise can push a tiny latency below zero: fit the bandwidth term alone
        alpha, beta = 0.0, float(a[:, 1] @ y / (a[:, 1] @ a[:, 1]))
    elif beta < 0:
        alpha, beta = float(a[:, 0] @ y / (a[:, 0] @ a[:, 0])), 0.0
    return float(alpha), float(beta)


_BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def bus_bandwidth(op: str, size_bytes: float, seconds: float, n: int) -> float:
    """Bus bandwidth in bytes/s, as nccl-tests reports it (nccl-tests doc/PERFORMANCE.md).

    algbw = S / t; busbw = algbw · factor, with factor 2(n-1)/n for all-reduce, (n-1)/n for
    reduce-scatter and all-gather, 1 for broadcast and reduce. busbw is comparable across n:
    it is the rate at which the busiest link works.
    """
    check_n(n)
    if op not in _BUS_FACTOR:
        raise ValueError(f"op must be one of {tuple(_BUS_FACTOR)}, got {op!r}")
    if not seconds > 0:
        raise ValueError(f"seconds must be positive, got {seconds!r}")
    return size_bytes / seconds * _BUS_FACTOR[op](n)
