"""ZeRO stage 3 (P_os+g+p), the paper's design: the parameters are sharded too, as flat units.

Rajbhandari et al., ZeRO (SC 2020), section 5.3; PyTorch FSDP1's ``FULL_SHARD`` does the same
with its flat parameter. The model is cut into *units* (by default every module that owns
parameters directly; or the modules you pass, e.g. the transformer blocks). Each unit's
parameters are one flat, padded bucket, and a rank keeps only its 1/N slice of it. Per step:

* **forward**: just before a unit runs, its parameters are all-gathered; just after, freed;
* **backward**: just before the unit's backward (a hook on its output's gradient), gathered
  again; once all its gradients are in, they are reduce-scattered (each rank keeps the
  average of its slice) and the full parameters and gradients are freed;
* **step**: the optimizer updates the shard; nothing else moves.

Two all-gathers and one reduce-scatter: ``3(N-1)/N * psi`` elements per rank per step, 1.5x
data parallelism (the paper's section 7). Parameters two units share (tied embeddings) form
the *root* unit: gathered when the forward starts, freed when the backward ends.

This file is when each unit is gathered, freed and reduce-scattered. A unit's flat bucket and
its collectives are :class:`engine.zero.flat.ShardedUnit`; what is not the algorithm
(prefetching, the log of what is gathered, autocast, the units' cut, the optimizer over the
shards) lives in :mod:`engine.zero.stage3_support`. This is the design chapter 4 teaches; the
composed engine (``engine train --zero 3``, :func:`engine.compose.parallelize.parallelize`)
trains with the per-parameter design that followed it (PyTorch FSDP2, :mod:`engine.fsdp`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine.dp.buckets import BucketLauncher
from engine.observe.memory import mark_held_by
from engine.validation import boolean
from engine.zero import stage3_support as support
from engine.zero.flat import ShardedUnit, check_params


class ZeroDataParallel(support.Measured, nn.Module):
    """ZeRO stage 3: ``model = ZeroDataParallel(module, torch.optim.AdamW, lr=1e-3)``; then
    ``loss = model(x)...; loss.backward(); model.optimizer.step(); model.optimizer.zero_grad()``.
    ``units``: the modules gathered and freed one at a time (default: every module that owns
    parameters directly); ``forward_prefetch``, ``backward_prefetch``: PyTorch FSDP's, with
    its defaults (:class:`engine.zero.stage3_support.Prefetch`); ``group``: the data-parallel
    group (default: the world); ``**kwargs``: the optimizer's, run on this rank's shards.
    Call the wrapper, ``model(x)``: it gathers the root unit first. What it holds and
    gathered: :class:`engine.zero.stage3_support.Measured`."""

    def __init__(self, module: nn.Module, optimizer_cls, units=None, *,
                 forward_prefetch: bool = False, backward_prefetch: bool = True, group=None,
                 **kwargs):
        super().__init__()
        support.check_optimizer_kwargs(kwargs)
        check_params(module.parameters())
        self.module, self.group = module, group
        self.world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        support.broadcast_from_first(module, group)  # every rank starts from the same values
        root, cut = support.make_units(module, units)
        groups = ([("(root)", root)] if root else []) + [(name, ps) for _, name, ps in cut]
        self.all_units = [ShardedUnit(name, ps, rank, self.world_size, i)
                          for i, (name, ps) in enumerate(groups)]
        self.root = self.all_units[0] if root else None
        self.units = self.all_units[1:] if root else self.all_units
        self.launcher = BucketLauncher(self.all_units, ordered=False, launch=self._launch,
                                       finish=self._finish_unit)
        self.optimizer = support.ShardOptimizer(
            self, optimizer_cls([u.master for u in self.all_units], **kwargs))
        self.log = support.GatherLog()
        self.prefetch = support.Prefetch(self.units, self._start,
                                         boolean("forward_prefetch", forward_prefetch),
                                         boolean("backward_prefetch", backward_prefetch))
        self.autocast = support.Autocast(self.launcher.bucket_of,
                                         self.all_units[0].shard.device.type)
        for unit, (mod, _, _) in zip(self.units, cut, strict=True):
            mod.register_forward_pre_hook(lambda _m, _a, u=unit: self._before_forward(u))
            mod.register_forward_hook(lambda _m, _a, out, u=unit: self._after_forward(u, out))
        for p in self.launcher.bucket_of:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        mark_held_by(self.launcher.bucket_of, self)  # module.parameters() are empty between uses

    # -- gather and free, each logged -----------------------------------------------------------

    def _start(self, unit: ShardedUnit, event: str) -> None:
        if unit.full is None and unit.pending is None:
            unit.start_gather(self.group)
            self.log.add(unit.full_bytes, f"gather {unit.name} ({event})")

    def _gather(self, unit: ShardedUnit, event: str) -> None:
        self._start(unit, event)
        if unit.full is None:
            unit.finish_gather()

    def _free(self, unit: ShardedUnit, event: str) -> None:
        if unit.full is not None:
            unit.free()
            self.log.add(-unit.full_bytes, f"free {unit.name} ({event})")

    # -- forward: gather, compute, free ---------------------------------------------------------

    def forward(self, *args, **kwargs):
        self.prefetch.forward_started()
        if self.root is not None:
            self._gather(self.root, "forward")
        with self.autocast.around_forward():  # under autocast, no bf16 copy kept for backward
            return self.module(*args, **kwargs)

    def _before_forward(self, unit: ShardedUnit) -> None:
        if torch.is_grad_enabled() or unit.full is None:
            self._gather(unit, "forward")
            self.prefetch.before_forward(unit)

    def _after_forward(self, unit: ShardedUnit, output) -> None:
        self._free(unit, "after forward")
        self.autocast.after_unit()
        if torch.is_grad_enabled():  # backward will need the unit again: a hook gathers it
            for t in support.output_tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda grad, u=unit: self._before_backward(u) or grad)
                    break

    # -- backward: gather, compute, reduce-scatter, free ---------------------------------------

    def _before_backward(self, unit: ShardedUnit) -> None:
        self.launcher.end.queue()
        self._gather(unit, "backward")
        self.prefetch.before_backward(unit)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        unit = self.launcher.bucket_of[p]
        unit.accumulate_grad(p)
        self.launcher.grad_ready(p, launch=unit is not self.root)  # the root waits for the end
        if unit.work is not None:  # its gradients are on their way: its parameters can go
            self._free(unit, "after backward")

    def _launch(self, unit: ShardedUnit):
        return unit.start_reduce_scatter(self.group)

    def _finish_unit(self, unit: ShardedUnit) -> None:
        unit.add_reduced_grad()
        if unit.pending is not None:  # prefetched, but its backward never came
            unit.finish_gather()
        self._free(unit, "end of backward")
