"""The compressor interface, shaped like PyTorch's DDP communication hooks.

A compressor is called once per gradient bucket, from inside backward, as
``compressor(bucket, group) -> work``. ``bucket`` is the data-parallel bucket: ``.buffer`` (the
flat gradients of this rank), ``.params`` and ``.views`` (each parameter's slice of the buffer,
shaped like it), ``.index`` and ``.is_last``. Once ``work.wait()`` returns, ``bucket.buffer``
holds the **average** over the group of what the ranks chose to send, exactly what PyTorch's
``register_comm_hook`` expects its future to hold.

Compressors talk only through :mod:`engine.comm.ops`, so ``CommMeter`` counts what each one
really puts on the wire: fewer bytes, and for sparse methods the indices too.
"""

from __future__ import annotations

import torch

from engine.validation import fraction


class Done:
    """The work of a compressor that finished inside the call (``wait()`` returns at once)."""

    def wait(self):
        return True

    def is_completed(self) -> bool:
        return True


class Then:
    """An async work, followed by ``finish()`` when it is waited on (decompress, divide)."""

    def __init__(self, work, finish):
        self.work, self.finish, self.done = work, finish, False

    def wait(self):
        if not self.done:
            self.work.wait()
            self.finish()
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


def check_float_bucket(buffer: torch.Tensor, who: str) -> None:
    if not buffer.is_floating_point():
        raise ValueError(f"{who} compresses floating-point gradients, got a bucket of "
                         f"{buffer.dtype}")


def check_ratio(ratio) -> float:
    return float(fraction("ratio", ratio))  # the fraction of coordinates kept
