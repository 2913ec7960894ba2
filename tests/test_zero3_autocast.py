"""ZeRO-3 under bf16 autocast (the GPU default, run here on the CPU, which PyTorch supports):
no bf16 copy of a unit's weights is kept from forward to backward, so what a rank holds after
the forward is what fp32 holds; the results equal one process's under autocast."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from engine.model.mlp import MLP
from engine.model.data import regression_data
from engine.train.strategy import autocast
from engine.zero import ZeroDataParallel
from tests.helpers import run_ranks

SIZES = (48, 64, 40, 8)  # no weight has the input's 6 x 48 elements


class _Casts(TorchDispatchMode):
    """Every bf16 copy of a weight-sized tensor made while active, watched by weak reference:
    :meth:`held` is the bytes of those still alive."""

    def __init__(self, numels):
        super().__init__()
        self.numels, self.refs = set(numels), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16 \
                and out.numel() in self.numels:
            self.refs.append(weakref.ref(out))
        return out

    def held(self) -> int:
        return sum(t.numel() * t.element_size() for ref in self.refs if (t := ref()) is not None)


def _step(rank, world_size, precision, zero, autocast_inside=False):
    """One AdamW step; ``autocast_inside``: the ZeRO-3 wrapper around the trainer's autocast
    wrapper (``engine.train.strategy.autocast``), as ``engine train --zero 3`` builds it."""
    torch.manual_seed(0)
    module = MLP(SIZES, seed=2)
    weights = [p.numel() for p in module.parameters() if p.dim() == 2]
    wrapped = autocast(module, precision) if autocast_inside else module
    model = ZeroDataParallel(wrapped, torch.optim.AdamW, lr=1e-2) if zero else module
    opt = model.optimizer if zero else torch.optim.AdamW(module.parameters(), lr=1e-2)
    x, y = regression_data(6, SIZES[0], SIZES[-1], seed=1)  # the same batch on every rank
    casts = _Casts(weights)
    outside = precision == "bf16" and not autocast_inside
    with casts, torch.autocast("cpu", dtype=torch.bfloat16, enabled=outside):
        loss = nn.functional.mse_loss(model(x).float(), y)
    held_after_forward = casts.held()
    gathered_after_forward = model.gathered_bytes if zero else None
    with casts:
        loss.backward()
    opt.step()
    if zero:
        for unit in model.all_units:
            unit.start_gather(None)
            unit.finish_gather()
        params = model.module.parameters()
    else:
        params = module.parameters()
    return dict(held=held_after_forward, gathered=gathered_after_forward,
                peak=model.peak_gathered_bytes if zero else None, loss=loss.item(),
                params=torch.cat([p.detach().reshape(-1) for p in params]),
                weights_bf16_bytes=2 * sum(weights[1:]))  # the first layer's input needs
    # no gradient, so its weight is not saved


@pytest.mark.parametrize("autocast_inside", [False, True], ids=["around", "inside"])
def test_zero3_under_bf16_autocast_keeps_no_bf16_copy_from_forward_to_backward(
        autocast_inside):
    plain = _step(0, 1, "bf16", zero=False)
    assert plain["held"] == plain["weights_bf16_bytes"] > 0  # what autograd keeps without ZeRO
    fp32 = run_ranks(_step, 2, "fp32", True)
    for ours, theirs in zip(run_ranks(_step, 2, "bf16", True, autocast_inside), fp32,
                            strict=True):
        assert ours["held"] == 0  # every unit's bf16 copy went with the unit
        assert ours["gathered"] == theirs["gathered"] == 0
        assert ours["peak"] == theirs["peak"]  # one unit at a time, in bf16 as in fp32
        assert ours["loss"] == plain["loss"]  # the same casts, cast again in backward
        assert torch.allclose(ours["params"], plain["params"], atol=1e-6, rtol=0)
