"""Exercise ch04.zero3_hooks: ZeRO-3's gather and free around each unit's forward and backward.

Under ZeRO-3 (Rajbhandari et al., ZeRO, SC 2020, section 5.3) a rank keeps only its 1/N
shard of every parameter. The model is cut into *units* (here: each linear layer); a unit's
parameters are gathered just before it runs and freed just after, in forward and again in
backward. Everything else is the engine's ``ZeroDataParallel`` (engine/zero/stage3.py), with
its hooks already registered: you write the four hooks.

What you can use, on ``self``:

* ``self._gather(unit, event)``: all-gather the unit's shards and point its parameters'
  ``.data`` into the full buffer (nothing happens if it is gathered already);
* ``self._free(unit, event)``: drop the full buffer, parameters empty again;
* ``self.launcher``: the gradient buckets' launcher (``engine.dp.buckets.BucketLauncher``):
  ``self.launcher.bucket_of[p]`` is ``p``'s unit, ``self.launcher.grad_ready(p)`` marks
  ``p``'s gradient as in and launches its unit's reduce-scatter once the unit is complete,
  ``self.launcher.end.queue()`` makes sure the end of backward finishes every unit;
* ``unit.accumulate_grad(p)``: add ``p.grad`` into the unit's flat gradient buffer;
  ``unit.work``: the unit's reduce-scatter, ``None`` until launched.

Fill in the four methods, save, then run ``check("ch04.zero3_hooks")`` in
course/04_zero.ipynb (or ``make grade``). The checks train 3 AdamW steps at 2 and 3 ranks and
compare the shards with the engine's ``ZeroDataParallel``; look at what a rank holds between
steps (shards only) and at most one unit gathered at a time; and count the bytes sent:
two all-gathers and one reduce-scatter, 3(N-1)/N of the (padded) parameters.
"""

from torch import nn

from engine.zero.stage3 import ZeroDataParallel


class Zero3(ZeroDataParallel):
    """``model = Zero3(module, torch.optim.AdamW, lr=1e-3)``; then ``model(x)``,
    ``loss.backward()``, ``model.optimizer.step()``, as with ``ZeroDataParallel``."""

    def __init__(self, module: nn.Module, optimizer_cls, units=None, group=None, **kwargs):
        super().__init__(module, optimizer_cls, units=units, forward_prefetch=False,
                         backward_prefetch=False, group=group, **kwargs)

    def _before_forward(self, unit) -> None:
        """Just before ``unit``'s forward: gather its parameters."""
        raise NotImplementedError("ch04.zero3_hooks: write me")

    def _after_forward(self, unit, output) -> None:
        """Just after ``unit``'s forward: free its parameters. Backward will need them again:
        register a hook on the first tensor of ``output`` that requires grad
        (``tensor.register_hook(fn)``; ``fn(grad)`` runs just before the unit's backward and
        must return ``grad``) that calls ``self._before_backward(unit)``."""
        raise NotImplementedError("ch04.zero3_hooks: write me")

    def _before_backward(self, unit) -> None:
        """Just before ``unit``'s backward: queue the end of backward, gather again."""
        raise NotImplementedError("ch04.zero3_hooks: write me")

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        """``p.grad`` is complete: add it into its unit's buffer, tell the launcher, and once
        the unit's reduce-scatter is launched, free the unit's parameters."""
        raise NotImplementedError("ch04.zero3_hooks: write me")
