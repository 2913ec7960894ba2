"""Reference for ch09.zigzag_indices (see exercises/ch09_zigzag_indices.py)."""


def zigzag_indices(seq_len: int, n: int, rank: int) -> list[int]:
    if seq_len % (2 * n):
        raise ValueError(f"sequence length {seq_len} does not split into 2 x {n} equal chunks")
    c = seq_len // (2 * n)
    return [*range(rank * c, (rank + 1) * c), *range((2 * n - 1 - rank) * c, (2 * n - rank) * c)]
