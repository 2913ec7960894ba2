"""One ``fully_shard`` call's parameters: gathered before the module runs, freed after,
gathered again for backward, their gradients reduce-scattered onto the shards.

The design of PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``; Zhao et al., "PyTorch
FSDP", VLDB 2023, for FSDP1's flat parameter it replaces; ZeRO stage 3, Rajbhandari et al.
2020, section 5.3), built from hooks and one autograd function:

* **gather** (forward pre-hook): :class:`Unshard` all-gathers every shard, cast to
  ``param_dtype``, in one collective (:func:`engine.fsdp.comm.all_gather`); the module's
  parameter slots point at the whole tensors while it runs.
* **compute**, then **free** (forward post-hook): the slots point at the shards again; with
  ``reshard_after_forward`` the whole tensors' storage is freed (``resize_(0)``: autograd keeps
  the tensors, not their bytes), and a hook on the module's outputs gathers them again when
  backward reaches it. The root (the sharded module whose forward runs first, found then:
  ``lazy_init``) keeps its parameters: backward starts with them.
* **reduce** (backward of :class:`Unshard`): autograd calls it once, when the gradients of all
  the group's whole parameters are complete; they are reduce-scattered in ``reduce_dtype``
  (:func:`engine.fsdp.comm.reduce_scatter`) and returned as the shards' gradients, which
  autograd accumulates into ``shard.grad``; the whole tensors are freed.

What is not the algorithm arrives from outside: ``later`` (:mod:`engine.fsdp.step`) keeps
gradients that are reduced after this backward (zero-bubble's deferred weight gradients, a
root held through a pipeline step) instead of reducing them; ``step`` is the whole tensors a
pipeline step keeps in the slots, the same ones for every micro-batch (:meth:`engine.fsdp.
step.ShardedStep.gathered`); ``observer(group, bytes)`` is told each gather (+) and free (-).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves  # how PyTorch's FSDP2 finds outputs too

from engine.fsdp import comm
from engine.fsdp.policy import MixedPrecisionPolicy
from engine.fsdp.shard import DimZeroShard


class ShardedParam:
    """A parameter's local shard, its layout, and the (module, name) slots that hold it
    (more than one for a tied parameter)."""

    def __init__(self, param: nn.Parameter, slots: list[tuple[nn.Module, str]],
                 world_size: int, rank: int):
        self.layout = DimZeroShard(param.shape, world_size, rank)
        self.shard = nn.Parameter(self.layout.take(param.detach()),
                                  requires_grad=param.requires_grad)
        self.shard.fsdp_layout = self.layout  # full_state_dict finds its shards by it
        self.slots = slots
        self.point_at(self.shard)

    def point_at(self, tensor: torch.Tensor) -> None:
        for module, name in self.slots:
            module._parameters[name] = tensor


class Gathered:
    """The whole parameters of one forward call (or one pipeline step), freed and filled
    again as backward needs."""

    def __init__(self, group: "ShardGroup", gather: bool):
        self.group, self.freed = group, False
        self.tensors = [torch.empty(p.layout.shape, dtype=group.gather_dtype,
                                    device=p.shard.device) for p in group.params]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors)
        for t, p in zip(self.tensors, group.params):
            t.fsdp_param = p  # a deferred weight gradient (W) finds its shard by it
        if gather:
            self.freed = True
            self.refill()
        else:  # empty until its first use
            self._resize(0)
            self.freed = True

    def _resize(self, full: int) -> None:
        for t in self.tensors:
            t.untyped_storage().resize_(full * t.numel() * t.element_size())

    def free(self) -> None:
        if not self.freed and not self.group.held:
            self._resize(0)
            self.freed = True
            self.group.observe(-self.nbytes)

    def refill(self, *_grad) -> None:
        if self.freed:
            self._resize(1)
            # autograd saved these tensors: new bytes, the same values, not a modification
            with torch.no_grad(), contextlib.ExitStack() as keep:
                for t in self.tensors:
                    keep.enter_context(torch.autograd._unsafe_preserve_version_counter(t))
                comm.all_gather(self.group.params, self.group.gather_dtype, self.group.group,
                                self.group.world_size, self.tensors)
            self.freed = False
            self.group.observe(self.nbytes)


class Unshard(torch.autograd.Function):
    """Forward: the shards -> the whole parameters (all-gather; ``gather=False``: empty, to be
    filled at each use). Backward: their gradients -> the shards' (reduce-scatter)."""

    @staticmethod
    def forward(ctx, group: "ShardGroup", gather: bool, *shards):
        ctx.set_materialize_grads(False)  # a gradient that did not come: None, not zeros
        ctx.group = group
        ctx.gathered = group.last = Gathered(group, gather)
        return tuple(ctx.gathered.tensors)

    @staticmethod
    def backward(ctx, *grads):
        group = ctx.group
        if group.later is not None and group.later.keeps(group):  # reduced after W / a step
            group.later.keep(group, grads)
            shard_grads = [None] * len(grads)
        else:
            dtype = group.policy.reduce_dtype or group.gather_dtype
            buffer = comm.pack(group.params, grads, None, dtype)
            shard_grads = comm.reduce_scatter(group.params, buffer, group.group)
        ctx.gathered.free()
        return (None, None, *shard_grads)


class ShardGroup:
    """The state ``fully_shard(module)`` attaches to ``module`` as ``module.fsdp_state``."""

    def __init__(self, module: nn.Module, group, reshard_after_forward: bool,
                 policy: MixedPrecisionPolicy, ignored: frozenset = frozenset()):
        self.module, self.group, self.policy = module, group, policy
        self.reshard_after_forward = reshard_after_forward
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        slots: dict[int, tuple[nn.Parameter, list]] = {}
        for owner in module.modules():
            for name, p in owner._parameters.items():
                if p is not None and not hasattr(p, "fsdp_layout") and id(p) not in ignored:
                    slots.setdefault(id(p), (p, []))[1].append((owner, name))
        self.params = [ShardedParam(p, where, self.world_size, self.rank)
                       for p, where in slots.values()]
        dtypes = {p.shard.dtype for p in self.params}
        if policy.param_dtype is None and len(dtypes) > 1:
            raise ValueError(f"fully_shard({type(module).__name__}): parameters of dtypes "
                             f"{sorted(map(str, dtypes))} gathered together; give "
                             "MixedPrecisionPolicy(param_dtype=...) or shard them apart")
        self.last: Gathered | None = None
        self.is_root: bool | None = None  # decided at the first forward (lazy_init)
        self.later = None  # what keeps gradients reduced after this backward (module docstring)
        self.step: Gathered | None = None  # the whole tensors of a pipeline step
        self.held = False  # whole through a pipeline step (its root)
        self.observer = None  # observer(group, bytes): each gather (+) and free (-)
        # the pre-hook also on a module whose children took every parameter: it is the root
        module.register_forward_pre_hook(self.pre_forward, with_kwargs=True)
        if self.params:
            module.register_forward_hook(self.post_forward)

    def lazy_init(self) -> None:
        """At the first forward, as PyTorch's FSDP2 does (``FSDPState._lazy_init``): the
        sharded module that runs first is the root, every sharded module inside it is not.
        Done then rather than at ``fully_shard`` time, when the modules around it may not be
        sharded yet."""
        if self.is_root is not None:
            return
        self.is_root = True
        for name, sub in self.module.named_modules():
            state = getattr(sub, "fsdp_state", None)
            if sub is self.module or state is None:
                continue
            if state.is_root is not None:
                raise RuntimeError(
                    f"fully_shard: {name!r} ({type(sub).__name__}) already ran forward as a "
                    f"root before {type(self.module).__name__} did; run the first forward "
                    "through the root module (as PyTorch's FSDP2 requires)")
            state.is_root = False

    @property
    def gather_dtype(self) -> torch.dtype:
        return self.policy.param_dtype or self.params[0].shard.dtype

    def observe(self, nbytes: int) -> None:
        if self.observer is not None:
            self.observer(self, nbytes)

    # -- the algorithm: gather, compute, free; gather again for backward -----------------------

    def pre_forward(self, module, args, kwargs):
        self.lazy_init()
        if not self.params:  # its children took every parameter: nothing to gather
            return args, kwargs
        if self.step is not None:  # a pipeline step: its tensors, filled again
            args = self.later.before_forward(self, args)
        else:
            wholes = Unshard.apply(self, True, *[p.shard for p in self.params])
            for p, whole in zip(self.params, wholes):
                p.point_at(whole)
        if self.policy.param_dtype is not None and self.policy.cast_forward_inputs:
            cast = lambda x: x.to(self.policy.param_dtype) \
                if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in kwargs.items()}
        return args, kwargs

    def post_forward(self, module, args, output):
        gathered = self.step or self.last
        if self.step is None:
            for p in self.params:
                p.point_at(p.shard)
        # every tensor of the output, however nested (dicts, dataclasses registered with
        # torch's pytree, tuples): a backward through any of them needs the parameters again
        needs_grad = [o for o in tree_leaves(output) if isinstance(o, torch.Tensor)
                      and o.requires_grad]
        if not needs_grad:  # no backward will come: nothing to keep
            gathered.free()
        elif self.reshard_after_forward and not self.is_root:
            gathered.free()
            for o in needs_grad:
                o.register_hook(gathered.refill)
        return output
