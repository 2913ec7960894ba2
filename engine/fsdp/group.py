"""One ``fully_shard`` call's parameters: gathered before the module runs, freed after,
gathered again for backward, their gradients reduce-scattered onto the shards.

The design of PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``; Zhao et al., "PyTorch
FSDP", VLDB 2023, for FSDP1's flat parameter it replaces), built from hooks and one autograd
function:

* **forward pre-hook**: :class:`Unshard` casts every shard to ``param_dtype``, all-gathers them
  in one collective (each rank's padded chunks side by side) and copies each parameter out
  whole; the module's parameter slots point at the whole tensors while it runs.
* **forward post-hook**: the slots point at the shards again; with ``reshard_after_forward``
  the whole tensors' storage is freed (``resize_(0)``: autograd keeps the tensors, not their
  bytes), and a hook on the module's outputs gathers them again when backward reaches it.
  The root (the sharded module whose forward runs first, found then: ``lazy_init``) keeps its
  parameters: backward starts with them.
* **backward** of :class:`Unshard`: autograd calls it once, when the gradients of all the
  group's whole parameters are complete; they are packed padded, reduce-scattered in
  ``reduce_dtype`` (summed, then divided by the group's size), cast to each shard's dtype and
  returned, each a copy of just its rows (not a view of the padded buffer): autograd
  accumulates them into ``shard.grad``, unpadded as the shard. The whole tensors are freed.

Every collective goes through :mod:`engine.comm.ops`, so a ``CommMeter`` counts it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves  # how PyTorch's FSDP2 finds outputs too

from engine.comm import ops
from engine.fsdp.policy import MixedPrecisionPolicy
from engine.fsdp.shard import DimZeroShard

def divide_before(n: int) -> int:
    """The power of two (about ``sqrt(n)``) an fp16 gradient is divided by before the sum of
    ``n`` ranks' (PyTorch's FSDP2, ``_get_gradient_divide_factors``)."""
    before = 1
    while n % before == 0 and n / before > before:
        before *= 2
    return before


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
    """The whole parameters of one forward call, freed and filled again as backward needs."""

    def __init__(self, group: "ShardGroup", tensors: list[torch.Tensor]):
        self.group, self.tensors, self.freed = group, tensors, False

    def free(self) -> None:
        for t in self.tensors:
            t.untyped_storage().resize_(0)
        self.freed = True

    def refill(self, *_grad) -> None:
        if self.freed:
            for t, whole in zip(self.tensors, self.group.all_gather()):
                t.untyped_storage().resize_(t.numel() * t.element_size())
                # autograd saved ``t``: new bytes, the same values, not a modification
                with torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x), \
                        torch.autograd._unsafe_preserve_version_counter(t):
                    t.copy_(whole)
            self.freed = False


class Unshard(torch.autograd.Function):
    """Forward: the shards -> the whole parameters (all-gather). Backward: their gradients
    -> the shards' (reduce-scatter)."""

    @staticmethod
    def forward(ctx, group: "ShardGroup", *shards):
        ctx.group = group
        ctx.gathered = group.last = Gathered(group, group.all_gather())
        return tuple(ctx.gathered.tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.gathered.refill()  # a module whose outputs took no hook (its outputs unused)
        shard_grads = ctx.group.reduce_scatter(grads)
        ctx.gathered.free()
        return (None, *shard_grads)


class ShardGroup:
    """The state ``fully_shard(module)`` attaches to ``module`` as ``module.fsdp_state``."""

    def __init__(self, module: nn.Module, group, reshard_after_forward: bool,
                 policy: MixedPrecisionPolicy):
        self.module, self.group, self.policy = module, group, policy
        self.reshard_after_forward = reshard_after_forward
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        slots: dict[int, tuple[nn.Parameter, list]] = {}
        for owner in module.modules():
            for name, p in owner._parameters.items():
                if p is not None and not hasattr(p, "fsdp_layout"):  # a child's: skip
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

    def all_gather(self) -> list[torch.Tensor]:
        """Every parameter whole, in ``param_dtype``: one all-gather of the padded chunks."""
        dtype, n = self.gather_dtype, self.world_size
        send = torch.cat([p.layout.padded(p.shard.detach(), dtype) for p in self.params])
        received = torch.empty(n * send.numel(), dtype=dtype, device=send.device)
        ops.all_gather_into_tensor(received, send, group=self.group)
        per_rank, out, offset = received.view(n, -1), [], 0
        for p in self.params:
            chunks = per_rank[:, offset:offset + p.layout.chunk_numel]
            out.append(p.layout.unpad(chunks.reshape(-1)).clone())
            offset += p.layout.chunk_numel
        return out

    def reduce_scatter(self, grads) -> list[torch.Tensor]:
        """The whole gradients -> this rank's rows of their mean over the ranks, in each
        shard's dtype (reduced in ``reduce_dtype``, default the gradients' dtype). Summed,
        then divided by ``N``; in fp16, as PyTorch does, divided by a power of two before the
        sum and by the rest after, so that the sum does not overflow."""
        n = self.world_size
        dtype = self.policy.reduce_dtype or self.gather_dtype
        chunk_numels = [p.layout.chunk_numel for p in self.params]
        device = self.params[0].shard.device
        send = torch.zeros(n, sum(chunk_numels), dtype=dtype, device=device)
        offset = 0
        for p, g in zip(self.params, grads):
            if g is not None:
                padded = torch.zeros(p.layout.padded_rows * p.layout.row_numel, dtype=dtype,
                                     device=device)
                padded[:g.numel()] = g.reshape(-1)
                send[:, offset:offset + p.layout.chunk_numel] = padded.view(n, -1)
            offset += p.layout.chunk_numel
        before = divide_before(n) if dtype == torch.float16 else 1
        if before != 1:
            send /= before
        mine = torch.empty(sum(chunk_numels), dtype=dtype, device=device)
        ops.reduce_scatter_tensor(mine, send.view(-1), group=self.group)
        mine /= n / before
        out, offset = [], 0
        for p in self.params:
            local = mine[offset:offset + p.shard.numel()].view(p.shard.shape)
            # a copy even in the same dtype: a view would keep all of ``mine`` alive, the
            # padded chunks of every parameter of the group, as the shards' gradients
            out.append(local.to(p.shard.dtype, copy=True))
            offset += p.layout.chunk_numel
        return out

    def pre_forward(self, module, args, kwargs):
        self.lazy_init()
        if not self.params:  # its children took every parameter: nothing to gather
            return args, kwargs
        wholes = Unshard.apply(self, *[p.shard for p in self.params])
        for p, whole in zip(self.params, wholes):
            p.point_at(whole)
        if self.policy.param_dtype is not None and self.policy.cast_forward_inputs:
            cast = lambda x: x.to(self.policy.param_dtype) \
                if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in kwargs.items()}
        return args, kwargs

    def post_forward(self, module, args, output):
        for p in self.params:
            p.point_at(p.shard)
        gathered = self.last
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
