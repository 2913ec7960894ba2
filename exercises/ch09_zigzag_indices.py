"""Exercise ch09.zigzag_indices: which tokens a rank holds in the zig-zag layout.

Fill in ``zigzag_indices``, save, then run ``check("ch09.zigzag_indices")`` in
course/09_long_context.ipynb (or ``make grade``). The checks compare your positions with the
layout ring attention uses, check that the ranks share every position once and the causal
work evenly, and that a length the layout cannot split raises a ValueError.
"""


def zigzag_indices(seq_len: int, n: int, rank: int) -> list[int]:
    """Positions (0 .. seq_len-1), in order, of the tokens ``rank`` of ``n`` holds.

    Cut the sequence into 2n equal chunks; rank r holds chunk r and chunk 2n-1-r (one early,
    one late). Raise ``ValueError`` naming the length when 2n chunks cannot be equal.
    """
    raise NotImplementedError("ch09.zigzag_indices: write me")
