"""The composed step (:func:`engine.compose.loop.train_step`) reads the step's loss to the host
once, after the last micro-batch's backward, however many micro-batches it accumulates: on a
GPU every read waits for the device, so a read per micro-batch would idle it inside the timed
step."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from engine.compose.loop import train_step
from engine.compose.model import GPT, ModelConfig
from engine.compose.parallelize import parallelize
from engine.compose.plan import Plan
from engine.model.data import global_batch
from tests.helpers import run_ranks

# what copies a tensor's value to the host (on a GPU: a synchronisation)
HOST_READS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu"}
CFG = ModelConfig(vocab=64, seq_len=8, layers=2, heads=2, hidden=16)


class HostReads(TorchFunctionMode):
    """Counts the tensor methods called that read a value to the host, in order, and where
    the backward passes fell among them."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def _reads(rank, world_size, m):
    plan = Plan(micro_batches=m)
    par = parallelize(GPT(CFG, seed=0), plan.mesh(), plan, torch.optim.SGD, lr=0.1)
    batch = global_batch(0, 2 * m, CFG.seq_len, CFG.vocab)
    backwards = []
    par.model.tok.weight.register_hook(lambda g: backwards.append(len(reads.reads)))
    with HostReads() as reads:
        loss = train_step(par, batch)
    return reads.reads, backwards, loss


def test_the_loss_is_read_once_after_the_last_backward_whatever_the_micro_batches():
    seen = {m: run_ranks(_reads, 1, m)[0] for m in (1, 4, 7)}
    for m, (reads, backwards, loss) in seen.items():
        assert len(backwards) == m, m  # one backward per micro-batch
        # no read between the micro-batches' backwards (the one before them is the global
        # token count, from the host's copy of the batch: no wait on a device) ...
        assert backwards == [backwards[0]] * m and reads[:backwards[0]] == ["item"], reads
        # ... and one read of the loss after the last; the same reads whatever m is
        assert reads[backwards[-1]:] == ["item"] and reads == seen[1][0], (m, reads)
        assert type(loss) is float
