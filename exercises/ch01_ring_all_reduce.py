"""Exercise ch01.ring_all_reduce: ring all-reduce from point-to-point sends.

Fill in ``ring_all_reduce``, save, then run ``check("ch01.ring_all_reduce")`` in
course/01_collectives.ipynb (or ``make grade``).
"""

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)

from engine.comm.ring import chunk_sizes, exchange  # noqa: F401  (and these)


def ring_all_reduce(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``t`` over all ranks, in place, with a ring; return ``t``.

    1. Cut ``t.view(-1)`` into N chunks with ``chunk_sizes(t.numel(), N)`` (``.split`` gives
       views, so writing into a chunk writes into ``t``).
    2. Reduce-scatter, N-1 steps: in step s send chunk (r-s-1) mod N to rank r+1 and receive
       chunk (r-s-2) mod N from rank r-1 into a scratch buffer, then add it into that chunk.
       ``exchange(send, dst, recv, src)`` does one send and one receive at once.
    3. All-gather, N-1 steps: in step s send chunk (r-s) mod N to the right, receive chunk
       (r-s-1) mod N from the left straight into place.

    Each rank then sends 2(N-1)/N of the tensor in all, below 2x for any N: check() measures
    it. Use ``group`` (its size, your rank in it, its members' global ranks) throughout.
    """
    raise NotImplementedError("ch01.ring_all_reduce: write me")
