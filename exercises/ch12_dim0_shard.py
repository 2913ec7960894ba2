"""Exercise ch12.dim0_shard: FSDP2's dim-0 shard of one parameter, padded, and its gather.

Fill in ``dim0_chunk`` and ``gather_dim0``, save, then run ``check("ch12.dim0_shard")`` in
course/12_precision_memory.ipynb (or ``make grade``). The checks use shapes whose first
dimension does not divide the number of ranks (10 rows over 4 ranks, 5 over 4, 3 over 2, ...)
and run ``gather_dim0`` on real ranks (3 and 4 of them), counting what it sends.

Tool: ``ops.all_gather_into_tensor(output, input, group=group)`` (through engine.comm.ops, so
the meter sees it): ``output`` is ``n`` times ``input``, the ranks' inputs side by side in
rank order.
"""

import torch  # noqa: F401  (you will need it)
import torch.distributed as dist  # noqa: F401

from engine.comm import ops  # noqa: F401


def dim0_chunk(full, rank, world_size):
    """Rank ``rank``'s padded chunk of ``full`` (any number of dims) on dim 0.

    Every rank's chunk has ``ceil(rows / world_size)`` rows (``rows = full.shape[0]``); rank r
    holds the rows ``r * chunk`` up to ``(r + 1) * chunk`` of ``full``, as many of them as
    exist, then rows of zeros up to ``chunk`` (the last ranks may hold few real rows, or none).
    Return a new tensor shaped ``(chunk, *full.shape[1:])``, same dtype.
    """
    raise NotImplementedError("ch12.dim0_shard: write me")


def gather_dim0(chunk, rows, group=None):
    """The full tensor again, on every rank of ``group``: ``chunk`` is this rank's padded
    chunk (as :func:`dim0_chunk` makes it) and ``rows`` the full tensor's first dimension.
    One all-gather of the chunks; return the first ``rows`` rows (no padding), shaped
    ``(rows, *chunk.shape[1:])``."""
    raise NotImplementedError("ch12.dim0_shard: write me")
