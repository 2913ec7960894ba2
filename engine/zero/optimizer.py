"""``ZeroOptimizer``: ZeRO stages 0, 1 and 2 as a ``torch.optim.Optimizer``.

Rajbhandari et al., "ZeRO: Memory optimizations toward training trillion parameter models"
(SC 2020), section 5:

* **stage 0** (plain data parallelism): gradients are all-reduced; every rank keeps the whole
  optimizer state.
* **stage 1** (P_os): every rank keeps the optimizer state of its 1/N shard only. At the step,
  gradients are reduce-scattered (each rank receives the average of its shard), the rank
  updates its shard, and the updated parameters are all-gathered. A reduce-scatter plus an
  all-gather move exactly what one all-reduce moves: no extra communication.
* **stage 2** (P_os+g): as stage 1, but the reduce-scatter runs during backward, bucket by
  bucket from gradient hooks, and each full gradient is freed as soon as it is in its bucket:
  a rank keeps only its 1/N of the gradients. That addition lives in
  :mod:`engine.zero.stage2` (:class:`~engine.zero.stage2.GradientSharding`); this class reads
  as stages 0 and 1, with the three places stage 2 changes marked.

With fp16/bf16 parameters the optimizer keeps fp32 master weights for its shard: the paper's
2 + 2 + 12 bytes per parameter (K = 12). With fp32 parameters the shard *is* the parameters'
memory, so there is no extra copy (4 + 4 + 8).

Stage 3 shards the parameters too, so it has to wrap the model: see
:class:`engine.zero.ZeroDataParallel`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine.comm import ops
from engine.observe.memory import StateBytes, StateTensors, count_state_bytes, optimizer_tensors
from engine.validation import positive_int
from engine.zero.flat import check_params, make_buckets
from engine.zero.stage2 import GradientSharding


class ZeroOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer_cls`` (e.g. ``torch.optim.AdamW``) so that it only ever sees this
    rank's shard of the parameters.

    Args:
        params: the model's parameters (one group; each ``.data`` becomes a view of a flat
            bucket, as with PyTorch's ``ZeroRedundancyOptimizer(parameters_as_bucket_view=
            True)``). They are broadcast from the group's first rank.
        optimizer_cls, **kwargs: the optimizer to run on the shard, and its arguments.
        stage: 0, 1 or 2 (3 needs the model: ``ZeroDataParallel``).
        group: the data-parallel group (default: the world).
        bucket_cap_mb: bucket size; in stage 2 the size of each reduce-scatter during backward
            (DeepSpeed's ``reduce_bucket_size``).
        offload: keep the fp32 master weights and the optimizer state in CPU memory and run the
            optimizer step there (ZeRO-Offload, Ren et al., USENIX ATC 2021): the accelerator
            keeps only parameters and gradients. Worth it when the GPU is what runs out.
        divide_by: what the gradients summed over ``group`` are divided by (default: the
            group's size, an average). Expert parallelism passes dp x cp, the ranks whose
            tokens an expert's gradient already sums (:mod:`engine.compose.experts`).
        compressor: stage 0 only: the step's all-reduce through a compressor of
            :mod:`engine.compress` (``compressor(bucket, group) -> work``, which leaves the
            average in ``bucket.buffer``), as :class:`engine.dp.DataParallel`'s; used where
            the gradients are reduced once a step (a pipeline's stage).

    Use it as any optimizer: ``loss.backward(); opt.step(); opt.zero_grad()``. In stages 0
    and 1 ``backward`` is the plain one (no DataParallel wrapper: the optimizer averages).
    """

    def __init__(self, params, optimizer_cls, stage: int = 1, group=None,
                 bucket_cap_mb: float = 25, offload: bool = False,
                 divide_by: int | None = None, compressor=None, **kwargs):
        if stage == 3:
            raise ValueError("stage 3 shards the parameters themselves, so it wraps the model: "
                             "use ZeroDataParallel(module, optimizer_cls, ...)")
        if stage not in (0, 1, 2):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
        if compressor is not None and (stage != 0 or divide_by is not None):
            raise ValueError(f"a compressor averages an all-reduce: it needs stage 0 and the "
                             f"group's own average, got stage {stage!r}, divide_by "
                             f"{divide_by!r}")
        params = check_params(params)
        super().__init__(params, {})
        self.compressor = compressor
        self.stage, self.group = stage, group
        self.world_size = dist.get_world_size(group)
        self.divide_by = self.world_size if divide_by is None else \
            positive_int("divide_by", divide_by)
        sharded = stage >= 1
        self.buckets = make_buckets(params, bucket_cap_mb,
                                    dist.get_rank(group) if sharded else 0,
                                    self.world_size if sharded else 1)
        for b in self.buckets:
            b.divide_by = self.divide_by
        root = ops.group_ranks(group)[0]
        for b in self.buckets:
            ops.broadcast(b.flat, root, group)
        self.offload = offload
        self.mixed = params[0].dtype != torch.float32
        # fp32 on the device: the optimizer updates the shard in place. fp16/bf16, or offload:
        # a separate fp32 master copy (on the CPU when offloading).
        self.separate_masters = self.mixed or offload
        for b in self.buckets:
            b.master = nn.Parameter(b.shard.detach().to("cpu" if offload else b.shard.device,
                                                        torch.float32, copy=True)
                                    if self.separate_masters else b.shard.detach())
        self.inner = optimizer_cls(self.masters, **kwargs)
        # stage 2: the gradients are reduce-scattered during backward (engine.zero.stage2)
        self.grad_sharding = GradientSharding(self.buckets, group) if stage == 2 else None
        if self.grad_sharding is not None:
            self.launcher = self.grad_sharding.launcher  # the buckets' launcher, as in DDP

    @property
    def masters(self) -> list[nn.Parameter]:
        """Each bucket's ``master``: what the inner optimizer updates."""
        return [b.master for b in self.buckets]

    # -- the step ----------------------------------------------------------------------------

    def _average_gradients(self) -> list[torch.Tensor]:
        """This rank's shard of the averaged gradient, per bucket."""
        if self.grad_sharding is not None:  # stage 2: reduced during backward already
            self.grad_sharding.flush_late_grads()  # (a full backward left in a late bucket)
            return self.grad_sharding.shard_grads()
        shards = []
        for b in self.buckets:
            full = b.flatten_grads()
            if self.compressor is not None:  # stage 0: it leaves the average in the buffer
                b.buffer = full
                self.compressor(b, self.group).wait()
                shards.append(b.buffer)
                b.buffer = None
            elif self.stage == 0:
                ops.all_reduce(full, group=self.group)
                shards.append(full.div_(self.divide_by))
            else:
                shards.append(self._reduce_scatter(full, b).div_(self.divide_by))
        return shards

    def _reduce_scatter(self, full: torch.Tensor, bucket) -> torch.Tensor:
        """The sum over ranks of this rank's slice of ``full`` (stage 1's gradients)."""
        shard = torch.empty_like(bucket.shard)
        ops.reduce_scatter_tensor(shard, full, group=self.group)
        return shard

    def _all_gather(self, bucket) -> None:
        """Every rank's updated slice into ``bucket.flat`` (stages 1 and 2)."""
        ops.all_gather_into_tensor(bucket.flat, bucket.shard.clone(), group=self.group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for master, grad in zip(self.masters, self._average_gradients(), strict=True):
            master.grad = grad.to(master.device, torch.float32) if self.separate_masters \
                else grad
        self.inner.step()
        for b, master in zip(self.buckets, self.masters, strict=True):
            master.grad = None  # the fp32 gradient shard lives only during the step
            if self.separate_masters:
                b.shard.copy_(master)  # back to the device, in the model's precision
            if self.stage >= 1:
                self._all_gather(b)
        return loss

    def state_dict(self):
        """Refused: torch's default would hold none of what this rank keeps (the inner
        optimizer's state over the shard, the fp32 masters), so a load would silently restore
        nothing. The composed engine saves them rank by rank
        (:func:`engine.compose.resume.rank_state`, :mod:`engine.checkpoint.per_rank`)."""
        raise TypeError("ZeroOptimizer.state_dict(): its state is the inner optimizer's over "
                        "this rank's shard (.inner) and the fp32 masters, which torch's "
                        "default state_dict would not hold; save a ZeRO run with the "
                        "composed engine (engine.compose.resume.rank_state, "
                        "engine.checkpoint.per_rank.save_per_rank)")

    def load_state_dict(self, state_dict) -> None:
        """Refused, as :meth:`state_dict` is."""
        self.state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self.grad_sharding is not None:  # stage 2: the accumulated shards too
            self.grad_sharding.zero()

    # -- measuring -----------------------------------------------------------------------------

    def state_tensors(self) -> StateTensors:
        """What this rank holds (see :mod:`engine.observe.memory`): parameters (the flat buckets,
        padding included), gradients (full ones and stage 2's shards) and optimizer state (the
        inner optimizer's, and fp32 master weights in mixed precision). With ``offload`` the
        optimizer state and the masters are in host memory: ``offloaded``."""
        grads = [p.grad for b in self.buckets for p in b.params if p.grad is not None]
        if self.grad_sharding is not None:  # stage 2: the shards of the gradients (and the
            grads += self.grad_sharding.shard_grads() + self.grad_sharding.late_buffers()  # W)
        state = optimizer_tensors(self.inner) + (self.masters if self.separate_masters else [])
        kept = list(getattr(self.compressor, "state_tensors", list)())  # a function: none
        return StateTensors(params=[b.flat for b in self.buckets], grads=grads,
                            optimizer=[] if self.offload else state, buffers=kept,
                            offloaded=state if self.offload else [])

    def state_bytes(self) -> StateBytes:
        """Bytes this rank holds on its device (and ``offloaded`` to the host), each storage
        counted once."""
        return count_state_bytes(self.state_tensors())

    def offloaded_bytes(self) -> int:
        """Bytes of master weights and optimizer state kept in CPU memory (``offload=True``)."""
        return self.state_bytes().offloaded
