"""Each rank's slice of the step's global batch (:func:`engine.model.data.global_batch`).

Of the batch, cut into ``m`` global micro-batches of ``B/m`` consecutive rows, the
data-parallel rank ``d`` takes, of micro-batch ``j``, rows ``j B/m + [d, d+1) B/(m dp)``
(Megatron-LM's sampler: the set of sequences of global micro-batch ``j`` is the same whatever
dp, which a statistic per micro-batch, the MoE balancing loss of :mod:`engine.compose.experts`,
needs); along the sequence, the tokens of its context-parallel index in the plan's layout
(:func:`engine.cp.layout.shard_indices`), with their positions.
"""

from __future__ import annotations

from engine.cp.layout import shard_indices
from engine.model.data import Batch


def rank_slice(batch: Batch, dp: int, dp_index: int, cp: int = 1, cp_index: int = 0,
               cp_layout: str = "zigzag", micro_batches: int = 1) -> list[Batch]:
    """This rank's micro-batches of ``batch``: of each of the ``micro_batches`` global
    micro-batches its data-parallel rows (module docstring), each holding its
    context-parallel tokens in ``cp_layout``."""
    rows = batch.ids.shape[0]
    if rows % (dp * micro_batches):
        raise ValueError(f"a global batch of {rows} rows does not split into dp x "
                         f"micro_batches = {dp} x {micro_batches} equal parts")
    per = rows // (dp * micro_batches)  # rows of one rank's micro-batch
    tokens = shard_indices(batch.ids.shape[1], cp, cp_index, cp_layout)
    positions = batch.positions[tokens]
    starts = [(j * dp + dp_index) * per for j in range(micro_batches)]
    return [Batch(*(t[start:start + per][:, tokens]
                    for t in (batch.ids, batch.targets, batch.mask)), positions)
            for start in starts]
