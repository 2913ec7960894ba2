"""Exercise ch02.accumulate: one optimizer step over k micro-batches, synchronised once.

Fill in ``accumulation_step``, save, then run ``check("ch02.accumulate")`` in
course/02_data_parallel.ipynb (or ``make grade``).
"""

from torch import nn


def accumulation_step(model, optimizer, micro_batches, loss_fn=nn.functional.mse_loss):
    """Take ONE optimizer step whose gradient is that of the mean loss over all micro-batches.

    ``model`` is an ``engine.dp.DataParallel``; ``micro_batches`` is a list of ``(x, y)`` of
    equal size. Run forward and backward on each micro-batch; only the last backward may
    synchronise (use ``model.no_sync()`` for the others), so one all-reduce per bucket happens
    in total. Scale each loss so the accumulated gradient is the *mean*, not the sum. Zero the
    gradients first; return the mean loss as a float.
    """
    raise NotImplementedError("ch02.accumulate: write me")
