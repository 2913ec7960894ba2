"""Exercise ch01.volume_formulas: how many bytes an all-reduce sends, per rank.

Each function takes the tensor size in bytes and the number of ranks N, and returns bytes
SENT by one rank for one all-reduce. In the parameter server, the server is one of the N ranks.
With N = 1 there is nobody to talk to: every function returns 0.
Graded with check("ch01.volume_formulas") on sizes and N you do not see.
"""


def ring_bytes_per_rank(size_bytes: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce."""
    raise NotImplementedError("ch01.volume_formulas: write me")


def ps_worker_bytes(size_bytes: float, n: int) -> float:
    """Bytes a worker sends in a parameter-server all-reduce."""
    raise NotImplementedError("ch01.volume_formulas: write me")


def ps_server_bytes(size_bytes: float, n: int) -> float:
    """Bytes the server sends in a parameter-server all-reduce."""
    raise NotImplementedError("ch01.volume_formulas: write me")
