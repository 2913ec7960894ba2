"""Dynamic loss scaling, from scratch: the decisions of ``torch.amp.GradScaler``.

Micikevicius et al., "Mixed Precision Training" (ICLR 2018), section 3.2: fp16's smallest
subnormal is 2^-24 (about 6e-8), so many small gradients round to zero. Multiplying the loss by
a scale ``S`` multiplies every gradient by ``S`` (backward is linear) and lifts them into range;
the optimizer then sees the gradients divided by ``S`` again, in fp32. Too large a scale makes
some gradient overflow to inf: the step is skipped and the scale halved ("back-off"); after
``growth_interval`` clean steps in a row the scale is doubled ("growth"), so it hovers just
below overflow.

:class:`DynamicLossScaler` is shaped like ``torch.amp.GradScaler``::

    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)   # optional: to clip the true gradients
    scaler.step(optimizer)       # skipped when any gradient is inf or NaN
    scaler.update()              # back off, or count a clean step and maybe grow

and makes the same decisions bit for bit: the scale is an fp32 tensor, its inverse is
computed in fp64 and rounded to fp32 as GradScaler does, and the update rule is
``torch._amp_update_scale_``'s (tests/test_precision.py runs both on one gradient sequence).
"""

from __future__ import annotations

import math

import torch

READY, UNSCALED, STEPPED = "ready", "unscaled", "stepped"


class DynamicLossScaler:
    """A loss scaler that grows by ``growth_factor`` after ``growth_interval`` clean steps and
    multiplies by ``backoff_factor`` (and skips the step) when a gradient is inf or NaN."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        if not init_scale > 0 or not math.isfinite(init_scale):
            raise ValueError(f"init_scale must be a positive finite number, got {init_scale!r}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if not (isinstance(growth_interval, int) and growth_interval > 0):
            raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}")
        self.scale_tensor = torch.tensor(init_scale, dtype=torch.float32)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.clean_steps = 0  # consecutive steps without inf/NaN (GradScaler's growth tracker)
        self.found_inf: dict[int, bool] = {}  # per optimizer, in this step's gradients
        self.stage: dict[int, str] = {}  # per optimizer, since the last update()
        self.skipped_steps = 0  # in total, for the experiments

    def get_scale(self) -> float:
        return self.scale_tensor.item()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S`` (the fp32 scale times the loss, as GradScaler multiplies them)."""
        return loss * self.scale_tensor.to(device=loss.device)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place and note any inf or NaN."""
        stage = self.stage.get(id(optimizer), READY)
        if stage == UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since "
                               "the last update()")
        if stage == STEPPED:
            raise RuntimeError("unscale_() is being called after step()")
        inverse = self.scale_tensor.double().reciprocal().float()
        found = False
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.dtype == torch.float16:
                    raise ValueError("unscale_ got fp16 gradients: keep fp32 master weights "
                                     "(the gradients of fp16 copies would lose the small "
                                     "values scaling rescued)")
                if not torch.isfinite(p.grad).all():
                    found = True
                p.grad.mul_(inverse.to(p.grad.device))
        self.stage[id(optimizer)] = UNSCALED
        self.found_inf[id(optimizer)] = found

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """Unscale if not done yet; step ``optimizer`` unless a gradient was inf or NaN.
        Returns what ``optimizer.step`` returned, or None for a skipped step."""
        if self.stage.get(id(optimizer), READY) == STEPPED:
            raise RuntimeError("step() has already been called since the last update()")
        if self.stage.get(id(optimizer), READY) == READY:
            self.unscale_(optimizer)
        self.stage[id(optimizer)] = STEPPED
        if self.found_inf[id(optimizer)]:  # only this optimizer's step is skipped
            return None
        return optimizer.step(*args, **kwargs)

    def update(self) -> None:
        """Back off after a step with inf/NaN in any optimizer's gradients; else count a
        clean step, growing the scale after ``growth_interval`` in a row (not past fp32's
        range)."""
        if not self.stage:
            raise RuntimeError("update() before any unscale_() or step(): no inf check made")
        if any(self.found_inf.values()):
            self.scale_tensor *= self.backoff_factor
            self.clean_steps = 0
            self.skipped_steps += 1
        else:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                grown = self.scale_tensor * self.growth_factor
                if torch.isfinite(grown):
                    self.scale_tensor = grown
                self.clean_steps = 0
        self.found_inf.clear()
        self.stage.clear()
