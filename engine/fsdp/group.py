"""One ``fully_shard`` call's parameters: gathered before the module runs, freed after,
gathered again for backward, their gradients reduce-scattered onto the shards.

The design of PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``; Zhao et al., "PyTorch
FSDP", VLDB 2023, for FSDP1's flat parameter it replaces; ZeRO stage 3, Rajbhandari et al.
2020, section 5.3), built from hooks and one autograd function:

* **gather** (forward pre-hook): :class:`Unshard` all-gathers every shard, cast to the
  policy's ``param_dtype``, in one collective; the module's slots hold the whole tensors.
* **compute**, then **free** (forward post-hook): the slots hold the shards again; the whole
  tensors' storage is freed (``resize_(0)``: autograd keeps the tensors, not their bytes),
  and a hook on the module's outputs (:meth:`ShardGroup.pre_backward`) gathers them again
  when backward reaches the module, into the slots while its backward runs (a recompute under
  activation checkpointing uses them). The root keeps its parameters: backward starts there.
* **reduce** (backward of :class:`Unshard`): autograd calls it once the gradients of all the
  group's whole parameters are complete; they are reduce-scattered in ``reduce_dtype``, the
  whole tensors freed, and the shards' gradients land in their ``.grad`` when the backward
  ends (the reduce-scatter travels while the modules before this one compute backward).

What is not the algorithm lives elsewhere: the collectives (:mod:`engine.fsdp.comm`), the
whole tensors freed and filled in place (:class:`engine.fsdp.gathered.Gathered`), the shards
and their slots (:mod:`engine.fsdp.shard`), the dtypes (:mod:`engine.fsdp.policy`),
which module is the root (:mod:`engine.fsdp.root`), which gathers start early, in forward
and in backward (:mod:`engine.fsdp.prefetch`), and what a pipeline adds
(:mod:`engine.fsdp.step`): ``later`` keeps gradients reduced after this backward, ``step`` is
the whole tensors a pipeline step keeps in the slots; ``observer(group, bytes)`` is told each
gather (+) and free (-).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves  # how PyTorch's FSDP2 finds outputs too

from engine.fsdp import comm
from engine.fsdp.gathered import Gathered
from engine.fsdp.policy import MixedPrecisionPolicy
from engine.fsdp.root import lazy_init
from engine.fsdp.shard import shard_params


class Unshard(torch.autograd.Function):
    """Forward: the shards -> the whole parameters (all-gather; ``gather=False``: empty, to be
    filled at each use). Backward: their gradients -> the shards' (reduce-scatter)."""

    @staticmethod
    def forward(ctx, group: "ShardGroup", gather: bool, *shards):
        ctx.set_materialize_grads(False)  # a gradient that did not come: None, not zeros
        comm.forget_unlanded()  # a backward that raised: its gradients belong to no step
        ctx.group = group
        ctx.gathered = group.last = Gathered(group, gather)
        return ctx.gathered.aliases()

    @staticmethod
    def backward(ctx, *grads):
        group = ctx.group
        if group.later is not None and group.later.keeps(group):  # reduced after W / a step
            group.later.keep(group, grads)
            shard_grads = [None] * len(grads)
        else:
            buffer = comm.pack(group.columns, grads, None, group.reduce_dtype)
            reduction = comm.Reduction(group.columns, buffer, group.group, async_op=True)
            comm.land_when_backward_ends(group.columns, reduction)  # into the shards' .grad
            shard_grads = [None] * len(grads)
        ctx.gathered.free()
        if group.backward is ctx.gathered:  # the module's backward is over: the shards again
            group.backward = None
            group.point_at(None)
        return (None, None, *shard_grads)


class ShardGroup:
    """The state ``fully_shard(module)`` attaches to ``module`` as ``module.fsdp_state``."""

    def __init__(self, module: nn.Module, group, reshard_after_forward: bool,
                 policy: MixedPrecisionPolicy, ignored: frozenset = frozenset()):
        self.module, self.group, self.policy = module, group, policy
        self.reshard_after_forward = reshard_after_forward
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.params = shard_params(module, self.world_size, self.rank, ignored)
        self.columns = comm.Columns(self.params) if self.params else None
        self.gather_dtype = policy.gather_dtype(self.params, type(module).__name__)
        self.nbytes = sum(p.layout.shape.numel() * self.gather_dtype.itemsize
                          for p in self.params)  # the group whole
        self.reduce_dtype = policy.reduce_dtype or self.gather_dtype
        self.last: Gathered | None = None  # of the last forward
        self.whole: tuple | None = None  # its Unshard's outputs, from pre- to post-forward
        self.backward: Gathered | None = None  # in the slots while the module's backward runs
        self.is_root: bool | None = None  # decided at the first forward (engine.fsdp.root)
        self.later = self.step = self.observer = None  # module docstring
        self.prefetch = None  # the root's Prefetch, shared (engine.fsdp.root)
        self.prefetched = None  # this group's forward all-gather, started early
        self.held = False  # whole through a pipeline step (its root)
        # the pre-hook also on a module whose children took every parameter: it is the root
        module.register_forward_pre_hook(self.pre_forward, with_kwargs=True)
        if self.params:
            # also when the forward raised: the slots hold the shards again, the bytes freed
            module.register_forward_hook(self.post_forward, always_call=True)

    def observe(self, nbytes: int) -> None:
        if self.observer is not None:
            self.observer(self, nbytes)

    def point_at(self, whole: tuple | None) -> None:
        """The slots hold ``whole``, :class:`Unshard`'s outputs (``None``: the shards)."""
        for i, p in enumerate(self.params):
            p.point_at(p.shard if whole is None else whole[i])

    # -- the algorithm: gather, compute, free; gather again for backward -----------------------

    def pre_forward(self, module, args, kwargs):
        lazy_init(self)
        if not self.params:  # its children took every parameter: nothing to gather
            return args, kwargs
        if self.step is not None:  # a pipeline step: its tensors, filled again
            args = self.later.before_forward(self, args)
        elif self.backward is None:  # (else a recompute in its backward: whole already)
            self.whole = Unshard.apply(self, True, *[p.shard for p in self.params])
            self.point_at(self.whole)
            self.prefetch.ran_forward(self)
        return self.policy.cast_inputs(args, kwargs)

    def post_forward(self, module, args, output):
        if self.backward is not None:  # a recompute in its backward: kept whole
            return output
        if self.step is None and self.whole is None:  # the pre-hook raised: nothing gathered
            return output
        if output is None and torch._C._current_graph_task_id() != -1:
            return output  # a recompute torch.utils.checkpoint stopped early (by raising)
        gathered, whole = self.step or self.last, self.whole
        self.whole = None  # its node points at this group: not kept here past the forward
        if self.step is None:
            self.point_at(None)
        # every tensor of the output, however nested (dicts, dataclasses registered with
        # torch's pytree, tuples): a backward through any of them needs the parameters again
        needs_grad = [o for o in tree_leaves(output) if isinstance(o, torch.Tensor)
                      and o.requires_grad]
        if not needs_grad:  # no backward will come: nothing to keep
            gathered.free()
        elif self.reshard_after_forward and not self.is_root:
            gathered.free()
            for o in needs_grad:
                o.register_hook(functools.partial(self.pre_backward, gathered, whole))
        return output

    def pre_backward(self, gathered: Gathered, whole: tuple | None, grad) -> None:
        """Backward reached the module: its parameters whole again, in the slots."""
        gathered.refill()
        if self.step is None:
            self.backward = gathered
            self.point_at(whole)
            self.prefetch.backward_reached(self)  # the next group's gather travels meanwhile
