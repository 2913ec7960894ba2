"""The tiny GPT trained with this package's ``fully_shard``, measured as :mod:`engine.fsdp2`
measures PyTorch's: losses, whole parameters, bytes held and collectives of one step.

:func:`side_by_side` runs three implementations of the same sharded training on one rank:
``"ours"`` (:func:`engine.fsdp.fully_shard`, per parameter), ``"torch"`` (PyTorch's FSDP2) and
``"zero3"`` (:class:`engine.zero.ZeroDataParallel`, FSDP1's flat buckets), each with AdamW on the
blocks as units and the root (embeddings, final norm) as the last.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.nn.functional as F

from engine.comm import CommMeter
from engine.fsdp.api import full_state_dict, fully_shard
from engine.fsdp.policy import MixedPrecisionPolicy
from engine.fsdp2 import Side, engine_side, torch_side
from engine.memory import StateTensors, count_state_bytes
from engine.models import GPTConfig, TinyGPT, token_data


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


def side_by_side(rank: int, world_size: int, cfg: GPTConfig, steps: int = 3, lr: float = 1e-2,
                 rows: int = 4) -> dict[str, Side]:
    """On every rank: the same GPT trained ``steps`` steps by ``fully_shard`` from here,
    PyTorch's FSDP2 and the flat-bucket ZeRO-3, each rank on its ``rows`` sequences."""
    torch.manual_seed(0)
    ids, targets = token_data(rows * world_size, cfg.seq_len, cfg.vocab, seed=1)
    mine = slice(rank * rows, (rank + 1) * rows)
    return {"ours": ours_side(cfg, ids[mine], targets[mine], steps, lr),
            "torch": torch_side(cfg, ids[mine], targets[mine], steps, lr),
            "zero3": engine_side(cfg, ids[mine], targets[mine], steps, lr)}
