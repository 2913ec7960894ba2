"""Exercise ch02.average_gradients: keep replicas identical the right way.

Fill in ``average_gradients``, save, then run ``check("ch02.average_gradients")`` in
course/02_data_parallel.ipynb (or ``make grade``).
"""

import torch.distributed as dist  # noqa: F401  (you will need it)

from engine.comm import ops  # noqa: F401  (and this)


def average_gradients(model, group=None) -> None:
    """After ``loss.backward()`` on each rank's shard, replace every ``param.grad`` by its mean
    over the ranks (use ``ops.all_reduce`` so the meter sees it). Every rank then takes the
    same optimizer step, and its Adam moments stay equal to every other rank's: averaging the
    *parameters* after local steps would not do that.
    """
    raise NotImplementedError("ch02.average_gradients: write me")
