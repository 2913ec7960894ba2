"""Distributed Muon: each matrix has an owner rank, which orthogonalises it whole.

Adam's update is elementwise, so ZeRO can give each rank any 1/N slice of every tensor
(:mod:`engine.zero`). Muon's is not: Newton-Schulz needs the whole momentum matrix, and
orthogonalising each rank's slice gives another update altogether (:func:`row_shard_update`
measures how far). Here the sharding unit becomes the matrix: each has an **owner**, as in
Keller Jordan's reference implementation (github.com/KellerJordan/Muon, ``muon.py``: after
DDP's all-reduce each rank updates every ``N``-th matrix and all-gathers it) and Essential AI's
("Practical Efficiency of Muon for Pretraining", 2025). Moonlight's distributed Muon (Liu et
al., "Muon is Scalable for LLM Training", 2025, section 2.3, Algorithm 1) is the other answer:
every rank gathers every matrix and runs Newton-Schulz on it, keeping its ZeRO-1 slice
(:class:`engine.optim.GatherMuon`). Here, with the all-reduce made a reduce-scatter to the
owners:

1. the gradients are packed by owner (greedy: largest matrix to the least loaded rank) into
   ``N`` equal segments, padded, and **reduce-scattered**: the owner receives the average of
   its matrices' gradients, whole;
2. the owner advances the momentum it alone holds (1/N of Muon's state per rank, as ZeRO-1),
   runs Newton-Schulz and steps its matrices;
3. the new matrices are **all-gathered** back to every rank.

The bytes are ZeRO-2's (a reduce-scatter and an all-gather of ``psi`` elements), times the
padding of the most loaded segment; the Newton-Schulz FLOPs are divided among the ranks in the
same proportion (counted here with ``torch.utils.flop_counter.FlopCounterMode``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from engine.comm import ops
from engine.optim.muon import check_hyperparameters, check_matrix, muon_update
from engine.optim.newton_schulz import newton_schulz


def assign_owners(sizes: list[int], world_size: int) -> list[int]:
    """The owner of each matrix: largest first, to the rank with the fewest elements so far."""
    load, owner = [0] * world_size, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += sizes[i]
    return owner


class DistributedMuon(torch.optim.Optimizer):
    """:class:`engine.optim.Muon` over the ranks of ``group``: same arguments and, up to the
    rounding of the gradient average, the same steps. Call after a plain (not all-reduced)
    backward on each rank's micro-batch: the step averages the gradients itself."""

    def __init__(self, params, group=None, lr: float = 0.02, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5):
        check_hyperparameters(lr, momentum)
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov,
                                      ns_steps=ns_steps))
        self.group = group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.entries = []  # (param, its group, owner, offset in the owner's segment)
        flat = [(p, g) for g in self.param_groups for p in g["params"]]
        for i, (p, _) in enumerate(flat):
            check_matrix(p, f"parameter {i}")
        owners = assign_owners([p.numel() for p, _ in flat], self.world_size)
        fill = [0] * self.world_size
        for (p, g), owner in zip(flat, owners):
            self.entries.append((p, g, owner, fill[owner]))
            fill[owner] += p.numel()
        self.segment = max(fill)  # every rank's segment padded to the largest
        self.owned_numel = fill[self.rank]
        self.ns_flops = 0  # Newton-Schulz FLOPs this rank ran, counted

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        n, seg = self.world_size, self.segment
        device = self.entries[0][0].device
        send = torch.zeros(n, seg, device=device)
        for p, _, owner, offset in self.entries:
            if p.grad is not None:
                send[owner, offset:offset + p.numel()] = p.grad.reshape(-1)
        mine = torch.empty(seg, device=device)
        ops.reduce_scatter_tensor(mine, send.view(-1), group=self.group)
        mine /= n
        new = torch.zeros(seg, device=device)
        with FlopCounterMode(display=False) as flops:
            for p, g, owner, offset in self.entries:
                if owner != self.rank:
                    continue
                grad = mine[offset:offset + p.numel()].view(p.shape)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                update = muon_update(grad, state["momentum_buffer"], g["momentum"],
                                     g["nesterov"], g["ns_steps"])
                new[offset:offset + p.numel()] = p.detach().clone().add_(
                    update, alpha=-g["lr"]).reshape(-1)
        self.ns_flops += flops.get_total_flops()
        gathered = torch.empty(n * seg, device=device)
        ops.all_gather_into_tensor(gathered, new, group=self.group)
        for p, _, owner, offset in self.entries:
            p.copy_(gathered[owner * seg + offset:owner * seg + offset + p.numel()]
                    .view(p.shape))
        return loss


def row_shard_update(matrix: torch.Tensor, world_size: int, steps: int = 5) -> torch.Tensor:
    """The naive sharded Muon: each rank orthogonalises only its dim-0 shard of the matrix
    (as ZeRO would slice it), the pieces stacked. Not Muon's update."""
    return torch.cat([newton_schulz(piece, steps) for piece in matrix.chunk(world_size)])


def naive_error(matrix: torch.Tensor, world_size: int, steps: int = 5) -> float:
    """Relative Frobenius distance of :func:`row_shard_update` from the whole matrix's."""
    whole = newton_schulz(matrix, steps)
    return ((row_shard_update(matrix, world_size, steps) - whole).norm() / whole.norm()).item()
