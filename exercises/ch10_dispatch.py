"""Exercise ch10.dispatch: send each token row to the rank holding its expert, and back.

Fill in ``dispatch`` and ``combine``, save, then run ``check("ch10.dispatch")`` in
course/10_moe.ipynb (or ``make grade``). The checks run them on 2 and 4 ranks with 8 experts
and uneven loads (some experts get no rows at all), compare what every rank's experts receive
and what comes back (values and gradients) with the answer computed from every rank's rows,
and count the all-to-alls: one for the rows going out, one for the rows coming back, and at
most one small all-to-all of the counts before them. Nothing else may cross the wire.

Tools (both go through engine.comm.ops, so the meter sees them):

* ``ops.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group)``
  for the counts (an int64 tensor);
* ``all_to_all(rows, output_splits, input_splits, group)``: the same for rows, differentiable
  (its backward is the all-to-all with the splits swapped).
"""

import torch  # noqa: F401  (you will need it)
import torch.distributed as dist  # noqa: F401

from engine.comm import ops  # noqa: F401
from engine.moe import all_to_all  # noqa: F401


def dispatch(tokens, expert, num_experts, group=None):
    """``tokens`` [M, h]: this rank's rows; ``expert`` [M]: the expert each row goes to. The
    ``n`` ranks of ``group`` hold ``num_experts / n`` consecutive experts each (rank r:
    experts ``r * E/n`` to ``(r+1) * E/n - 1``).

    Return ``(received, counts, state)``:

    * ``received``: the rows this rank's experts must process, one block per local expert
      (its first expert's rows first); inside a block, the rows of rank 0 first, then rank 1,
      ..., each rank's rows in their original order;
    * ``counts``: a list, the number of rows in each block;
    * ``state``: anything :func:`combine` needs.

    Steps: sort the rows by expert (a stable sort keeps each expert's rows in order); count
    the rows per expert; exchange the counts (one all-to-all of E integers: rank s then knows
    how many rows of each of its experts arrive from every rank); exchange the rows (one
    all-to-all with those uneven splits); what arrives is ordered by source rank, then expert:
    regroup it by expert, then source rank.
    """
    raise NotImplementedError("ch10.dispatch: write me")


def combine(outputs, state):
    """The inverse of :func:`dispatch`: ``outputs`` has one row per row of ``received`` (the
    experts' results, in the same order); send each back to the rank it came from and return
    them ``[M, h]`` in the order of the original ``tokens``. One all-to-all."""
    raise NotImplementedError("ch10.dispatch: write me")
