"""One clock for the whole engine: ``time.perf_counter`` seconds, for host and GPU work alike.

On the CPU a mark is ``perf_counter()``. On a GPU kernels run asynchronously, so the host's
clock would time their launch, not their execution: a mark is a CUDA event recorded on the
device's current stream, and :meth:`Clock.seconds` converts it, after the fact, against a
reference event recorded (and waited for, once) together with a host timestamp. No
synchronisation between marks, so timing does not change what it measures.

The lowest layer of the engine's timing: :class:`engine.observe.trace.Clock` (compute timelines) and
the :class:`engine.observe.meter.CommMeter` (collectives on CUDA tensors) both use it.
"""

from __future__ import annotations

import time

import torch


class Clock:
    """Timestamps on ``device``, in ``time.perf_counter`` seconds (see the module docstring)."""

    def __init__(self, device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.reference = torch.cuda.Event(enable_timing=True)
            self.reference.record(torch.cuda.current_stream(self.device))
            self.reference.synchronize()
            self.host = time.perf_counter()

    def mark(self):
        """Now: a ``perf_counter`` reading on the CPU, a CUDA event on the stream on a GPU."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def synchronize(self) -> None:
        """Wait until everything queued on the device has run, on every stream (nothing to
        wait for on the CPU)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def seconds(self, mark) -> float:
        """A mark as ``perf_counter`` seconds (on a GPU, waits for the mark's event)."""
        if not self.cuda:
            return mark
        mark.synchronize()
        return self.host + self.reference.elapsed_time(mark) / 1e3
