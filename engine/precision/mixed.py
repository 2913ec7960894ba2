"""Mixed-precision training with fp32 master weights, and fp16's underflow counted.

Micikevicius et al., "Mixed Precision Training" (ICLR 2018): the optimizer keeps fp32 master
weights; each step runs forward and backward on a copy in the low precision (fp16 or bf16),
and the copy's gradients, cast to fp32, update the masters. bf16 has fp32's exponent range, so
its gradients do not underflow; fp16's smallest subnormal is 2^-24 and small gradients round to
zero ("flushed") unless the loss is scaled (:class:`engine.precision.DynamicLossScaler`).

Where each tensor lives, per parameter of ``P`` elements: master ``4P`` B (fp32), the working
copy ``2P`` B, its gradient ``2P`` B, the master's gradient ``4P`` B, Adam's moments ``8P`` B:
:func:`bytes_per_parameter` returns that table.

The experiments use a small tanh MLP with small weights (std 0.02), whose early layers get
gradients below fp16's range: :func:`gradient_underflow` counts the gradient elements that are
non-zero in fp32 and zero in fp16; :func:`train_mixed` trains the same net in fp32, bf16, fp16
and fp16 with the scaler, and reports losses, flushed gradients and skipped steps.

:func:`underflow_experiment` makes the failure decisive. With Adam it hardly shows: Adam divides
each gradient by its own size, so a gradient that survives as a subnormal still moves its weight
a full step, and only the elements flushed to exactly zero stop. With SGD the step is the
gradient itself. A mean loss's gradients shrink as ``1/N`` with the ``N`` elements averaged
(tokens x outputs x accumulation steps); at this toy size ``N`` is small, so a power-of-two
``loss_weight`` (``2^-16``) stands in for a large ``N``, and SGD's learning rate is divided by
it. In fp32 and bf16 (8 exponent bits) multiplying by a power of two is exact, so their runs are
bit-identical to the unweighted ones (tested); fp16's 5 exponent bits flush the gradients, and
the loss stalls; the loss scaler brings them back and fp16 trains like bf16.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.observe.memory import unique_storage_bytes
from engine.model.data import noise_regression_data, teacher_data
from engine.model.seed import seeded
from engine.precision.loss_scaler import DynamicLossScaler

LOW = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
       "fp16+scaler": torch.float16}


def bytes_per_parameter(low: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Bytes per parameter element of each tensor mixed precision with Adam keeps."""
    size = torch.empty((), dtype=low).element_size()
    return {"master (fp32)": 4, "working copy": size, "working gradient": size,
            "master gradient (fp32)": 4, "Adam moments (fp32)": 8}


def small_mlp(layers: int = 4, width: int = 64, std: float = 0.02, seed: int = 0) -> nn.Module:
    """Tanh MLP with N(0, std) weights: small weights make small gradients upstream."""
    modules: list[nn.Module] = []
    with seeded(seed):
        for _ in range(layers):
            linear = nn.Linear(width, width)
            nn.init.normal_(linear.weight, std=std)
            nn.init.zeros_(linear.bias)
            modules += [linear, nn.Tanh()]
    return nn.Sequential(*modules[:-1])


@dataclass
class Underflow:
    nonzero: int  # gradient elements that are non-zero in fp32
    flushed: int  # of those, zero in the low precision
    overflowed: int  # inf or NaN in the low precision

    @property
    def flushed_fraction(self) -> float:
        return self.flushed / max(self.nonzero, 1)


def low_precision_grads(master: nn.Module, x, y, dtype: torch.dtype, scale: float = 1.0,
                        keep: list | None = None, loss_weight: float = 1.0,
                        fp32_loss: bool = False):
    """(fp32 loss, gradients cast to fp32, still scaled) of a ``dtype`` copy of ``master``
    whose loss (``loss_weight`` x the mean squared error) is multiplied by ``scale`` before
    backward (the copy appended to ``keep``). ``fp32_loss``: the loss computed from the output
    cast to fp32, as autocast does (a fp16 loss times a scale of ``2^16`` or more is inf)."""
    work = copy.deepcopy(master).to(dtype)
    out = work(x.to(dtype))
    loss = loss_weight * (nn.functional.mse_loss(out.float(), y.float()) if fp32_loss
                          else nn.functional.mse_loss(out, y.to(dtype)))
    (loss * scale).backward()
    if keep is not None:
        keep.append(work)
    return loss.float().item(), [p.grad.float() for p in work.parameters()]


def gradient_underflow(master: nn.Module, x, y, dtype=torch.float16,
                       scale: float = 1.0, loss_weight: float = 1.0,
                       fp32_loss: bool = False) -> Underflow:
    """Count the gradient elements a ``dtype`` forward/backward flushes to zero (or overflows)
    against fp32's, with the loss multiplied by ``scale``."""
    _, grads = low_precision_grads(master, x, y, dtype, scale, loss_weight=loss_weight,
                                   fp32_loss=fp32_loss)
    return count_underflow(master, x, y, grads, loss_weight)


def count_underflow(master: nn.Module, x, y, grads, loss_weight: float = 1.0) -> Underflow:
    """:func:`gradient_underflow`'s count for low-precision ``grads`` already computed."""
    reference = copy.deepcopy(master)
    (loss_weight * nn.functional.mse_loss(reference(x), y)).backward()
    nonzero = flushed = overflowed = 0
    for p, g in zip(reference.parameters(), grads):
        nonzero += int((p.grad != 0).sum())
        flushed += int(((p.grad != 0) & (g == 0)).sum())
        overflowed += int((~torch.isfinite(g)).sum())
    return Underflow(nonzero, flushed, overflowed)


def held_bytes(master: nn.Module, working: nn.Module, optimizer) -> dict[str, int]:
    """Bytes of each tensor mixed precision keeps, counted from the tensors themselves (each
    storage once): :func:`bytes_per_parameter` times the parameter count, plus Adam's step
    counters."""
    def size(tensors):
        return unique_storage_bytes([t for t in tensors if t is not None])
    return {"master (fp32)": size(master.parameters()),
            "working copy": size(working.parameters()),
            "working gradient": size(p.grad for p in working.parameters()),
            "master gradient (fp32)": size(p.grad for p in master.parameters()),
            "optimizer state": size(v for state in optimizer.state.values()
                                    for v in state.values() if isinstance(v, torch.Tensor))}


@dataclass
class MixedRun:
    precision: str
    losses: list[float] = field(default_factory=list)
    flushed: list[int] = field(default_factory=list)  # per step, against fp32's gradients
    scales: list[float] = field(default_factory=list)  # the loss scale used at each step
    skipped: int = 0
    held: dict[str, int] = field(default_factory=dict)  # bytes of each kind, counted


def train_mixed(precision: str, steps: int = 50, lr: float = 1e-3, growth_interval: int = 10,
                init_scale: float = 2.0**16, rows: int = 1024, optimizer: str = "adam",
                loss_weight: float = 1.0, master: nn.Module | None = None,
                data=None, fp32_loss: bool = False) -> MixedRun:
    """``optimizer`` (``"adam"`` or ``"sgd"``, whose learning rate is divided by
    ``loss_weight``) on fp32 masters (default :func:`small_mlp` on
    :func:`engine.model.data.noise_regression_data`),
    forward/backward in ``precision`` (one of ``LOW``); ``"fp16+scaler"`` scales the loss with a
    :class:`DynamicLossScaler`. The losses reported are the unweighted mean squared errors."""
    if precision not in LOW:
        raise ValueError(f"precision={precision!r}; expected one of {tuple(LOW)}")
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer={optimizer!r}; expected 'adam' or 'sgd'")
    master = small_mlp() if master is None else master
    x, y = noise_regression_data(rows) if data is None else data
    optimizer = torch.optim.Adam(master.parameters(), lr=lr) if optimizer == "adam" else \
        torch.optim.SGD(master.parameters(), lr=lr / loss_weight)
    scaler = DynamicLossScaler(init_scale, growth_interval=growth_interval) \
        if precision == "fp16+scaler" else None
    run = MixedRun(precision)
    for _ in range(steps):
        scale = scaler.get_scale() if scaler else 1.0
        working: list[nn.Module] = []
        loss, grads = low_precision_grads(master, x, y, LOW[precision], scale, working,
                                          loss_weight, fp32_loss)
        count = count_underflow(master, x, y, grads, loss_weight)  # before the step
        for p, g in zip(master.parameters(), grads):
            p.grad = g  # the scaler divides them by the scale itself
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        run.held = held_bytes(master, working[0], optimizer)
        optimizer.zero_grad()
        run.losses.append(loss / loss_weight)
        run.flushed.append(count.flushed)
        run.scales.append(scale)
    run.skipped = scaler.skipped_steps if scaler else 0
    return run


def underflow_experiment(steps: int = 60, loss_weight: float = 2.0**-16, lr: float = 0.5,
                         rows: int = 256, width: int = 32, seed: int = 0,
                         precisions=tuple(LOW)) -> dict[str, MixedRun]:
    """SGD on a 4-layer tanh MLP (std ``1/sqrt(width)``) fitting :func:`engine.model.data.teacher_data`, the
    loss (computed in fp32, as under autocast) weighted by ``loss_weight`` (module
    docstring), in each of ``precisions``."""
    return {p: train_mixed(p, steps, lr, init_scale=2.0**16, growth_interval=10,
                           optimizer="sgd", loss_weight=loss_weight, fp32_loss=True,
                           master=small_mlp(4, width, width**-0.5, seed),
                           data=teacher_data(rows, width, seed + 1)) for p in precisions}
