"""Reference for exercise ch01.volume_formulas."""


def ring_bytes_per_rank(size_bytes: float, n: int) -> float:
    """2(N-1)/N·S: N-1 chunks of S/N in reduce-scatter, N-1 more in all-gather."""
    return 2 * (n - 1) / n * size_bytes


def ps_worker_bytes(size_bytes: float, n: int) -> float:
    """The worker sends its whole gradient once (and receives the sum once)."""
    return size_bytes if n > 1 else 0


def ps_server_bytes(size_bytes: float, n: int) -> float:
    """The server sends the sum to each of the N-1 workers."""
    return (n - 1) * size_bytes
