"""``engine.train.steps.accumulate_micro_batches`` reads its losses to the host once, after the last
micro-batch (on a GPU every read waits for the device: a read per micro-batch would idle it
inside the timed step), and reports the very same loss as one ``.item()`` per micro-batch did,
bit for bit."""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from engine.train.steps import accumulate_micro_batches

# what copies a tensor's value to the host (on a GPU: a synchronisation)
HOST_READS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu"}


class HostReads(TorchFunctionMode):
    """Counts the tensor methods called that read a value to the host, in order."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def _run(m: int, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))
    inputs = [torch.randn(5, 16) for _ in range(m)]
    labels = [torch.randint(0, 16, (5,)) for _ in range(m)]
    seen, backwards = [], []

    def losses(x, y):
        loss = nn.functional.cross_entropy(model(x), y)
        seen.append(loss.detach())
        loss.register_hook(lambda g: backwards.append(len(reads.reads)))
        return loss, loss

    with HostReads() as reads:
        run = accumulate_micro_batches(losses, inputs, labels, list(model.parameters()), 0)
    return run, seen, reads.reads, backwards


def test_the_loss_is_read_once_after_the_last_backward_and_is_bit_identical():
    for m in (1, 4, 7):
        run, seen, reads, backwards = _run(m, seed=m)
        # the loss as the old code computed it: one .item() per micro-batch, summed in Python
        assert run.loss == sum((loss / m).item() for loss in seen), m
        assert type(run.loss) is float
        assert reads == ["tolist"], reads  # one read to the host, of all m losses at once
        assert backwards == [0] * m  # and no read before any backward ran
        assert len(run.events) == m
