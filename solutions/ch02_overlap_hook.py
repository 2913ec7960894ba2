"""Reference for exercise ch02.overlap_hook."""

from torch import nn


def on_grad_ready(p: nn.Parameter, buckets: list, bucket_of: dict, launch) -> None:
    """Copy the gradient into its bucket; launch every complete bucket, in bucket order."""
    bucket = bucket_of[p]
    bucket.view_of(p, bucket.buffer).copy_(p.grad)
    bucket.ready.add(p)
    for b in buckets:
        if not b.complete:
            break
        if b.work is None:
            b.work = launch(b)
