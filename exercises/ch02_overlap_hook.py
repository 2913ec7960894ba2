"""Exercise ch02.overlap_hook: DDP's overlap, the hook that launches each bucket's all-reduce.

The engine's ``DataParallel`` (engine/dp/data_parallel.py) packs the gradients into buckets,
last layer first, and registers a hook that autograd calls the moment a parameter's gradient
is complete. Here you write that hook. The checks plug it into ``DataParallel`` in place of
the engine's, train 3 steps at 2 and 3 ranks, and compare every gradient with the engine's
own ``DataParallel``; then they read the meter: one all-reduce per bucket, in bucket order,
each one launched before backward ended. One model runs its layers in another order than it
declares them, so its gradients do not arrive bucket by bucket.

Fill in ``on_grad_ready``, save, then run ``check("ch02.overlap_hook")`` in
course/02_data_parallel.ipynb (or ``make grade``).
"""

from torch import nn

from engine.dp.buckets import GradBucket  # noqa: F401  (what a bucket holds: read it)


def on_grad_ready(p: nn.Parameter, buckets: list, bucket_of: dict, launch) -> None:
    """Called during backward, the moment ``p.grad`` is complete.

    ``buckets``: the ``GradBucket`` s in launch order (``buckets[0]`` holds the last layer's
    parameters). ``bucket_of[p]``: the bucket that holds ``p``. ``launch(bucket)`` starts
    that bucket's all-reduce asynchronously and returns its work.

    1. Copy ``p.grad`` into ``p``'s place in its bucket's flat ``buffer``
       (``bucket.view_of(p, bucket.buffer)`` is that place, shaped like ``p``).
    2. Mark ``p`` as ready (``bucket.ready``).
    3. Launch, in bucket order, every bucket that is complete and not launched yet
       (``bucket.work is None``): store what ``launch`` returns in ``bucket.work``. Stop at
       the first bucket that is not complete, even if a later one is: every rank must issue
       the same all-reduces in the same order, or they would pair up wrongly.

    The end of backward is handled for you: it launches any bucket left, waits for every
    one, and turns the sums into averages in ``p.grad``.
    """
    raise NotImplementedError("ch02.overlap_hook: write me")
