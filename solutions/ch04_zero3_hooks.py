"""Reference for exercise ch04.zero3_hooks."""

import torch
from torch import nn

from engine.zero.stage3 import ZeroDataParallel


class Zero3(ZeroDataParallel):
    """ZeroDataParallel without prefetch, its four hooks written out."""

    def __init__(self, module: nn.Module, optimizer_cls, units=None, group=None, **kwargs):
        super().__init__(module, optimizer_cls, units=units, forward_prefetch=False,
                         backward_prefetch=False, group=group, **kwargs)

    def _before_forward(self, unit) -> None:
        self._gather(unit, "forward")

    def _after_forward(self, unit, output) -> None:
        self._free(unit, "after forward")
        tensors = output if isinstance(output, (tuple, list)) else [output]
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad: self._before_backward(unit) or grad)
                break

    def _before_backward(self, unit) -> None:
        self.launcher.end.queue()
        self._gather(unit, "backward")

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        unit = self.launcher.bucket_of[p]
        unit.accumulate_grad(p)
        self.launcher.grad_ready(p)
        if unit.work is not None:
            self._free(unit, "after backward")
