"""What a pipeline adds to per-parameter ZeRO-3 (:mod:`engine.fsdp.group`): a step of many
micro-batches whose chunks the runtime calls directly, and gradients that come after their
backward (zero-bubble's W). A strategy object, :class:`ShardedStep`, over a model whose
modules are ``fully_shard``-ed; the kernel only asks it, in backward, whether to keep a group's
gradients for later (``group.later``).

* **the step** (:meth:`ShardedStep.gathered`): the runtime calls the chunks, not the root
  module, and runs a backward at every B. For the step every group's slots hold the same whole
  tensors (:meth:`ShardedStep._open`), empty until a forward or a backward
  fills them and freed after each (:class:`FreeAfterBackward`), so the runtime's deferral of
  the linear layers
  (:mod:`engine.pp.weight_grad`, by parameter identity) sees them. The root's own parameters
  (a tied embedding two chunks of one rank share, under the V placement) are *held*: gathered
  at their first use, kept, their gradients kept and reduce-scattered once at the step's end.
* **late gradients** (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): after
  :meth:`ShardedStep.defer_gradients`, the groups holding the linear layers are late: their
  backward (B) keeps what came (a bias added outside the linear layer) in the padded matrix a
  reduce-scatter sends, frees the whole tensors as usual; W adds ``dW = dY^T X`` there
  (:meth:`add_late_grad`: no gather, W needs no weight) and :meth:`reduce_late_grads`
  reduce-scatters the groups it filled, so every group is reduce-scattered once per
  micro-batch, at its B or at its W.
* **accounting**: the bytes gathered now and at most (``gathered_bytes``,
  ``peak_gathered_bytes``), told by each group (``group.observer``).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from engine.fsdp import comm
from engine.fsdp.group import Unshard
from engine.fsdp.root import lazy_init


class FreeAfterBackward(torch.autograd.Function):
    """The identity on a module's inputs, whose backward frees the group once the module's
    backward is done: before the backward of the module that made the inputs gathers its own
    (PyTorch FSDP2's ``RegisterPostBackwardFunction``). A pipeline step needs it: there the
    :class:`Unshard` node, made once for the step, runs only at the end of each backward."""

    @staticmethod
    def forward(ctx, gathered, *inputs):
        ctx.gathered = gathered
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.gathered.free()
        return (None, *grads)


class ShardedStep:
    """The groups of ``model`` (``fully_shard``-ed, ``model`` last: its root) for a pipeline
    step (module docstring); also the holder of late gradients the W actions call
    (:func:`engine.compose.pipeline.sharded_weight_grads`)."""

    def __init__(self, model: nn.Module):
        self.root = model.fsdp_state
        self.groups = [m.fsdp_state for m in model.modules()
                       if getattr(m, "fsdp_state", None) is not None and m.fsdp_state.params]
        self.group_of = {id(p): g for g in self.groups for p in g.params}
        self.late: list = []  # the groups W fills, in the groups' order
        self.waiting: dict = {}  # group -> the padded gradients it keeps for later
        self._filled: list = []  # the late groups the current W added to
        self.gathered_bytes = self.peak_gathered_bytes = 0
        for group in self.groups:
            group.observer = self._account

    def _account(self, group, nbytes: int) -> None:
        self.gathered_bytes += nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    @contextlib.contextmanager
    def gathered(self):
        """Through a pipeline step (module docstring); the gradients kept are reduce-scattered
        at its end (a failed step drops them)."""
        lazy_init(self.root)
        for group in self.groups:
            group.later = self
            self._open(group, held=group is self.root)
        try:
            yield
            for group in self.groups:
                if group in self.waiting:
                    group.held = False
                    self._reduce(group)
        except BaseException:
            self.drop_late_grads()
            raise
        finally:
            for group in self.groups:
                group.held = False
                group.step.free()
                group.step = None
                for p in group.params:
                    p.point_at(p.shard)

    @staticmethod
    def _open(group, held: bool) -> None:
        """Point ``group``'s slots at whole tensors, empty until a forward fills them, kept
        to the step's end; ``held``: not freed in between (used by modules the runtime calls,
        not by the root itself: gathered now)."""
        group.held = held
        whole = Unshard.apply(group, False, *[p.shard for p in group.params])
        group.step = group.last
        group.point_at(whole)
        if held:
            group.step.refill()

    @staticmethod
    def before_forward(group, args: tuple) -> tuple:
        """A group's forward in the step: its tensors filled again; the module's inputs pass
        through :class:`FreeAfterBackward` (unless the group stays whole)."""
        group.step.refill()
        wrap = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not wrap or not group.reshard_after_forward or group.is_root:
            return args
        args = list(args)
        for i, a in zip(wrap, FreeAfterBackward.apply(group.step, *[args[i] for i in wrap])):
            args[i] = a
        return tuple(args)

    # -- what backward asks (engine.fsdp.group.Unshard) -------------------------------------

    def keeps(self, group) -> bool:
        return group.held or group in self.late

    def keep(self, group, grads) -> None:
        self.waiting[group] = comm.pack(group.columns, grads, self.waiting.get(group),
                                        group.reduce_dtype)

    # -- late gradients (W) -------------------------------------------------------------------

    def defer_gradients(self, params) -> None:
        """The groups holding ``params`` (shards) get some of their gradients in W."""
        of_shard = {id(p.shard): g for g in self.groups for p in g.params}
        late = {id(of_shard[id(p)]) for p in params if id(p) in of_shard}
        self.late = [g for g in self.groups if id(g) in late]

    @property
    def late_groups(self) -> list:
        return self.late

    def holds(self, weight) -> bool:
        """Whether ``weight`` (a whole tensor a linear layer ran with) is in a late group."""
        param = getattr(weight, "fsdp_param", None)
        return param is not None and self.group_of.get(id(param)) in self.late

    def add_late_grad(self, weight, grad) -> None:
        """Add ``grad`` (``weight``'s shape) to its place in its group's padded gradients."""
        param = weight.fsdp_param
        group = self.group_of[id(param)]
        self.keep(group, [grad if q is param else None for q in group.params])
        if group not in self._filled:
            self._filled.append(group)

    def reduce_late_grads(self) -> None:
        """After a W action: reduce-scatter the groups it filled (a held root waits for the
        step's end), in the groups' order, the same on every rank."""
        filled, self._filled = self._filled, []
        for group in self.late:
            if group in filled and not group.held:
                self._reduce(group)

    def flush_late_grads(self) -> None:
        """Reduce-scatter every group whose gradients still wait (a backward not split)."""
        for group in self.groups:
            if group in self.waiting and not group.held:
                self._reduce(group)

    def drop_late_grads(self) -> None:
        self.waiting.clear()
        self._filled = []

    def late_buffers(self) -> list:
        """The padded gradients waiting now: memory this rank holds."""
        return list(self.waiting.values())

    def _reduce(self, group) -> None:
        grads = comm.reduce_scatter(group.columns, self.waiting.pop(group), group.group)
        for p, grad in zip(group.params, grads):
            p.shard.grad = grad if p.shard.grad is None else p.shard.grad.add_(grad)
