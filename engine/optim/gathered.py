"""Distributed Muon as Moonlight's Algorithm 1: ZeRO-1's even partition kept, every matrix
gathered whole on every rank, Newton-Schulz run redundantly.

Liu et al., "Muon is Scalable for LLM Training" (2025), section 2.3, build Muon into
Megatron-LM's distributed optimizer (ZeRO-1): the momentum and the parameters are partitioned
over the data-parallel ranks as one flat buffer cut into ``N`` equal slices, whatever the matrix
boundaries. One step (their Algorithm 1):

1. **reduce-scatter** the gradients: each rank receives the average of its slice;
2. apply the momentum to that slice with the momentum slice it holds (elementwise, as Adam's);
3. **DP gather**: all-gather the momentum-updated slices, so that every rank has every matrix
   whole;
4. Newton-Schulz on every matrix, **on every rank** (the same work ``N`` times over);
5. keep this rank's slice of the result and update its slice of the parameters;
6. **all-gather** the updated parameters.

Beside :class:`engine.optim.DistributedMuon` (each matrix owned by one rank: Keller Jordan's
reference implementation and Essential AI's): three collectives of ``ceil(psi / N)`` elements
a rank instead of two of the largest owner's load, and ``N`` times the Newton-Schulz FLOPs in
all instead of each matrix once; in return the momentum is split evenly whatever the matrices'
sizes, and the partition is ZeRO-1's own. The update is this engine's Muon
(:func:`engine.optim.muon_update`'s rule, Keller Jordan's shape scale; Moonlight's own scales by
``0.2 sqrt(max(rows, cols))``), so the steps equal :class:`engine.optim.Muon`'s up to the
rounding of the gradient average.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from engine.comm import ops
from engine.optim.muon import check_hyperparameters, check_matrix, shape_scale
from engine.optim.newton_schulz import newton_schulz


class GatherMuon(torch.optim.Optimizer):
    """Muon over the ranks of ``group`` as Moonlight's Algorithm 1. Call after a plain (not
    all-reduced) backward on each rank's micro-batch: the step averages the gradients itself."""

    def __init__(self, params, group=None, lr: float = 0.02, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5):
        check_hyperparameters(lr, momentum)
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov,
                                      ns_steps=ns_steps))
        self.group = group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.entries, offset = [], 0  # (param, its group, offset in the flat buffer)
        for g in self.param_groups:
            for p in g["params"]:
                check_matrix(p, f"parameter {len(self.entries)}")
                self.entries.append((p, g, offset))
                offset += p.numel()
        self.psi = offset
        self.chunk = -(-offset // self.world_size)  # every rank's slice, the last padded
        self.start = self.rank * self.chunk
        device = self.entries[0][0].device
        self.momentum_slice = torch.zeros(self.chunk, device=device)  # 1/N of Muon's state
        self.ns_flops = 0  # Newton-Schulz FLOPs this rank ran, counted

    def _mine(self, offset: int, numel: int) -> tuple[int, int]:
        """``[lo, hi)`` of a parameter's flat elements inside this rank's slice (maybe empty)."""
        lo = min(max(self.start - offset, 0), numel)
        return lo, max(lo, min(self.start + self.chunk - offset, numel))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        n, chunk, device = self.world_size, self.chunk, self.momentum_slice.device
        send = torch.zeros(n * chunk, device=device)
        for p, _, offset in self.entries:
            if p.grad is not None:
                send[offset:offset + p.numel()] = p.grad.reshape(-1)
        grad = torch.empty(chunk, device=device)
        ops.reduce_scatter_tensor(grad, send, group=self.group)  # 1. the slice's average
        grad /= n
        blended = torch.zeros(chunk, device=device)
        for p, g, offset in self.entries:  # 2. momentum on the slice, elementwise
            lo, hi = self._mine(offset, p.numel())
            if lo == hi:
                continue
            here = slice(offset + lo - self.start, offset + hi - self.start)
            momentum, beta = self.momentum_slice[here], g["momentum"]
            momentum.lerp_(grad[here], 1 - beta)
            blended[here] = grad[here].lerp(momentum, beta) if g["nesterov"] else momentum
        whole = torch.empty(n * chunk, device=device)
        ops.all_gather_into_tensor(whole, blended, group=self.group)  # 3. every matrix whole
        new = torch.zeros(chunk, device=device)
        with FlopCounterMode(display=False) as flops:
            for p, g, offset in self.entries:  # 4. every matrix, on every rank
                matrix = whole[offset:offset + p.numel()].view(p.size(0), -1)
                update = newton_schulz(matrix, g["ns_steps"]) * shape_scale(*matrix.shape)
                lo, hi = self._mine(offset, p.numel())  # 5. keep this rank's slice
                if lo < hi:
                    new[offset + lo - self.start:offset + hi - self.start] = \
                        p.reshape(-1)[lo:hi].clone().add_(update.reshape(-1)[lo:hi],
                                                          alpha=-g["lr"])
        self.ns_flops += flops.get_total_flops()
        gathered = torch.empty(n * chunk, device=device)
        ops.all_gather_into_tensor(gathered, new, group=self.group)  # 6. the new parameters
        for p, _, offset in self.entries:
            p.copy_(gathered[offset:offset + p.numel()].view(p.shape))
        return loss
