"""ZeRO-3 beside PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard`` on a ``DeviceMesh``),
and the engine's :class:`~engine.topology.Mesh` beside ``init_device_mesh``.

The names map one to one:

=================================  ====================================================
engine                             PyTorch
=================================  ====================================================
``ZeroDataParallel(m, units=...)`` ``fully_shard(unit)`` on each unit, then on the root
a unit (a flat, padded bucket)     an FSDP param group (each parameter sharded on dim 0)
``ZeroOptimizer`` stage 1          ``ZeroRedundancyOptimizer`` (with DDP: it broadcasts
                                   updated parameters, 1.5x the bytes of ZeRO-1)
``ZeroOptimizer`` stage 2          ``fully_shard(reshard_after_forward=False)``
                                   (``SHARD_GRAD_OP`` in FSDP1)
``Mesh(dp=, tp=, pp=)``            ``init_device_mesh(device, (pp, dp, tp),
                                   mesh_dim_names=("pp", "dp", "tp"))``
``mesh.dp_group``                  ``device_mesh["dp"].get_group()``
=================================  ====================================================

:func:`side_by_side` trains the same GPT both ways on the same ranks and data, and returns,
per rank, the losses, the whole parameters after the last step, the bytes each holds
(:func:`engine.observe.memory.count_state_bytes`: unique storages of parameters, gradients and
optimizer state; FSDP2's are the local shards of its DTensors) and the collectives of one
step: the engine's from :class:`engine.observe.meter.CommMeter`, PyTorch's by wrapping the
``torch.distributed`` functions FSDP2 calls while the step runs (:class:`TorchCollectives`).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine import theory
from engine.observe.meter import CommMeter
from engine.observe.patching import patched
from engine.observe.memory import StateBytes, StateTensors, count_state_bytes
from engine.fsdp.api import full_state_dict, fully_shard
from engine.fsdp.policy import MixedPrecisionPolicy
from engine.model.gpt import GPTConfig, TinyGPT
from engine.model.data import token_data

# torch.distributed's collectives, as FSDP2 (torch 2.13) calls them: dist.all_gather_single
# and dist.reduce_scatter_single, the rest for completeness
WRAPPED = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
           "reduce_scatter_tensor", "all_reduce", "broadcast", "all_gather", "reduce_scatter",
           "all_to_all_single")
# the names both sides share in the table
KIND = {"all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
        "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter"}


@dataclass
class Call:
    op: str  # "all_gather", "reduce_scatter", ...
    full_bytes: int  # the gathered output, or the input to reduce-scatter
    ranks: int


@dataclass
class TorchCollectives(contextlib.AbstractContextManager):
    """While open, every ``torch.distributed`` collective in :data:`WRAPPED` called through
    ``torch.distributed`` is recorded (op, bytes, group size) and then run as usual."""

    calls: list[Call] = field(default_factory=list)

    def __enter__(self):
        self._patch = patched(dist, **{name: self._wrap(name, getattr(dist, name))
                                       for name in WRAPPED if hasattr(dist, name)})
        self._patch.__enter__()
        return self

    def __exit__(self, *exc):
        self._patch.__exit__(*exc)
        return False

    def _wrap(self, name, fn):
        def recorded(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            big = max(tensors, key=torch.Tensor.numel)  # the gathered output, or the input
            group = kwargs.get("group")                 # that is reduce-scattered
            self.calls.append(Call(KIND.get(name, name), big.numel() * big.element_size(),
                                   dist.get_world_size(group)))
            return fn(*args, **kwargs)
        return recorded


@dataclass
class Side:
    """One implementation's run on one rank."""

    losses: list[float]
    params: dict[str, torch.Tensor]  # whole, after the last step
    held: StateBytes  # after the last step, before its gradients are dropped
    calls: Counter  # op -> count, in one step
    bytes_sent: int  # in one step: counted on the wire (engine), ring formula (PyTorch)


def _loss(model, ids, targets):
    logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _train(model, optimizer, ids, targets, steps, measure, record):
    """``steps`` steps; the one at index 1 (a steady one) runs inside ``measure()``."""
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        with measure() if step == 1 else contextlib.nullcontext() as seen:
            loss = _loss(model, ids, targets)
            loss.backward()
            optimizer.step()
        if step == 1:
            record(seen)
        losses.append(loss.item())
    return losses


def engine_side(cfg: GPTConfig, ids, targets, steps: int, lr: float) -> Side:
    """:class:`engine.zero.ZeroDataParallel` with the transformer blocks as units (the root
    unit: embeddings, final LayerNorm), AdamW."""
    from engine.zero import ZeroDataParallel

    gpt = TinyGPT(cfg, seed=0)
    model = ZeroDataParallel(gpt, torch.optim.AdamW, units=list(gpt.blocks), lr=lr)
    seen = {}
    losses = _train(model, model.optimizer, ids, targets, steps, CommMeter,
                    lambda meter: seen.update(events=meter.events))
    held = model.state_bytes()
    for unit in model.all_units:  # whole parameters, to compare
        unit.start_gather(model.group)
        unit.finish_gather()
    params = {n: p.detach().clone() for n, p in gpt.named_parameters()}
    for unit in model.all_units:
        unit.free()
    events = seen["events"]
    return Side(losses, params, held, Counter(e.op for e in events),
                sum(e.bytes_sent for e in events))


def torch_side(cfg: GPTConfig, ids, targets, steps: int, lr: float) -> Side:
    """FSDP2: ``fully_shard`` on each transformer block, then on the model (the root group:
    embeddings, final LayerNorm), on a one-dimensional CPU ``DeviceMesh``, AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gpt = TinyGPT(cfg, seed=0)
    for block in gpt.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(gpt, mesh=mesh)
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=lr)
    seen = {}
    losses = _train(gpt, optimizer, ids, targets, steps, TorchCollectives,
                    lambda counter: seen.update(calls=counter.calls))
    held = count_state_bytes(StateTensors(
        params=[p.to_local() for p in gpt.parameters()],
        grads=[p.grad.to_local() for p in gpt.parameters() if p.grad is not None],
        optimizer=[v.to_local() if hasattr(v, "to_local") else v
                   for state in optimizer.state.values() for v in state.values()
                   if isinstance(v, torch.Tensor)]))
    params = {n: p.full_tensor() for n, p in gpt.named_parameters()}
    calls = seen["calls"]
    return Side(losses, params, held, Counter(c.op for c in calls),
                sum(round(_ring_bytes(c)) for c in calls))


def _ring_bytes(call: Call) -> float:
    if call.op == "all_gather":
        return theory.ring_all_gather_bytes(call.full_bytes, call.ranks)
    if call.op == "reduce_scatter":
        return theory.ring_reduce_scatter_bytes(call.full_bytes, call.ranks)
    if call.op == "all_reduce":
        return theory.ring_all_reduce_bytes(call.full_bytes, call.ranks)
    return float(call.full_bytes)


def held_tensors(module, optimizer) -> StateTensors:
    """What a ``fully_shard``-ed module and its optimizer hold between steps: the shards,
    their gradients, the optimizer's state."""
    params = list(module.parameters())
    return StateTensors(params=params, grads=[p.grad for p in params if p.grad is not None],
                        optimizer=[v for state in optimizer.state.values()
                                   for v in state.values() if isinstance(v, torch.Tensor)])


def ours_side(cfg: GPTConfig, ids, targets, steps: int, lr: float,
              policy: MixedPrecisionPolicy = MixedPrecisionPolicy()) -> Side:
    gpt = TinyGPT(cfg, seed=0)
    for block in gpt.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(gpt, mp_policy=policy)
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=lr)
    losses, seen = [], None
    for step in range(steps):
        optimizer.zero_grad()
        with CommMeter() if step == 1 else contextlib.nullcontext() as meter:
            logits = gpt(ids)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                                   targets.reshape(-1))
            loss.backward()
            optimizer.step()
        seen = meter.events if step == 1 else seen
        losses.append(loss.item())
    held = count_state_bytes(held_tensors(gpt, optimizer))
    return Side(losses, full_state_dict(gpt), held, Counter(e.op for e in seen),
                sum(e.bytes_sent for e in seen))


SIDES = ("zero3", "ours", "torch")


def side_by_side(rank: int, world_size: int, cfg: GPTConfig, steps: int = 3, lr: float = 1e-2,
                 rows: int = 4, sides: tuple[str, ...] = ("zero3", "torch")) -> dict[str, Side]:
    """On every rank: the same GPT trained ``steps`` steps by each of ``sides``, each rank on
    its ``rows`` sequences of one fixed global batch: ``"zero3"`` the engine's flat-bucket
    ZeRO-3 (:class:`engine.zero.ZeroDataParallel`, FSDP1's design), ``"ours"`` the engine's
    per-parameter ``fully_shard`` (:mod:`engine.fsdp`, FSDP2's design), ``"torch"`` PyTorch's
    FSDP2."""
    unknown = [s for s in sides if s not in SIDES]
    if unknown or not sides:
        raise ValueError(f"sides must be some of {SIDES}, got {sides!r}")
    torch.manual_seed(0)
    ids, targets = token_data(rows * world_size, cfg.seq_len, cfg.vocab, seed=1)
    mine = slice(rank * rows, (rank + 1) * rows)
    run = {"zero3": engine_side, "ours": ours_side, "torch": torch_side}
    return {side: run[side](cfg, ids[mine], targets[mine], steps, lr) for side in sides}


def mesh_rank_sets(rank: int, world_size: int, dp: int, tp: int, pp: int
                   ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """This rank's dp, tp and pp groups as ``(engine's ranks, init_device_mesh's ranks)``."""
    from torch.distributed.device_mesh import init_device_mesh

    from engine.comm import ops
    from engine.topology import Mesh

    ours = Mesh(dp=dp, tp=tp, pp=pp)
    theirs = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    return {name: (ops.group_ranks(getattr(ours, f"{name}_group")),
                   tuple(dist.get_process_group_ranks(theirs[name].get_group())))
            for name in ("dp", "tp", "pp")}

