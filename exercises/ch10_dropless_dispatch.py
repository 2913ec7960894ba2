"""Exercise ch10.dropless_dispatch: a dropless MoE layer's expert part, over real ranks.

Fill in ``dropless_moe``, save, then run ``check("ch10.dropless_dispatch")`` in
course/10_moe.ipynb (or ``make grade``). The checks run it on 2 and 4 ranks with 8 experts and
a skewed router (expert 0 gets about half of every rank's assignments, some experts none): no
capacity, so **no assignment may be dropped**. They compare every rank's output and the
gradients of its inputs, its gates and its experts with one process computing every
assignment; they record the batch each of your experts is called on (each local expert once,
on all its rows from every rank together); and they count the bytes on the wire: one
all-to-all of rows out and one back, carrying exactly the rows that change rank (no padding to
a capacity), after at most one small all-to-all of int64 counts.

Tools (both go through engine.comm.ops, so the meter sees them):

* ``ops.all_to_all_single(output, input, group=group)`` for the counts (an int64 tensor);
* ``all_to_all(rows, output_splits, input_splits, group)``: the same for rows, differentiable
  (its backward is the all-to-all with the splits swapped).

Your ch10.dispatch answer is most of it: copy it in. The engine's own dispatch and combine are
switched off while this exercise is graded.
"""

import torch  # noqa: F401  (you will need it)
import torch.distributed as dist  # noqa: F401

from engine.comm import ops  # noqa: F401
from engine.moe import all_to_all  # noqa: F401


def dropless_moe(x, expert, gate, experts, num_experts, group=None):
    """``x`` [T, h]: this rank's tokens; ``expert`` [T, k] (int64): each token's k experts;
    ``gate`` [T, k]: their weights; ``experts``: this rank's ``num_experts / n`` expert
    modules (rank r holds experts ``r * E/n`` to ``(r+1) * E/n - 1`` of the ``n`` ranks of
    ``group``).

    Return ``out`` [T, h] with ``out[t] = sum_j gate[t, j] * expert_{expert[t, j]}(x[t])`` for
    **every** assignment (no capacity, nothing dropped).

    Steps: one row per assignment (token t repeated k times); sort the rows by expert; exchange
    the counts, then the rows (uneven splits); regroup what arrived by local expert; run each
    local expert **once** on its whole block; send the results back (the splits swapped);
    undo the sort; weight each by its gate and add the k rows of each token
    (``index_add``).
    """
    raise NotImplementedError("ch10.dropless_dispatch: write me")
