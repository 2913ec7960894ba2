"""A replica's whole training state as one byte tensor: what a live peer sends to a replica
that rejoins (torchft's live recovery: from a peer's memory, not from disk).

``torch.save`` of the model's ``state_dict``, the optimizer's ``state_dict`` and the step
counter; loading it gives the same bits (parameters and every optimizer tensor, AdamW's step
counts included). A ``signature`` (the parameters' names, shapes and dtypes) travels with it:
a replica of another model is refused with the difference named, and so is one whose optimizer
is of another class or has other hyperparameters (:func:`optimizer_signature`).
"""

from __future__ import annotations

import hashlib
import io

import torch
from torch import nn


def signature(model: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """Names, shapes and dtypes of the model's parameters and buffers."""
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in model.state_dict().items()]


def optimizer_signature(optimizer: torch.optim.Optimizer) -> list:
    """The optimizer's class and, per parameter group, its hyperparameters' names and how
    many parameters it holds: what a rejoining replica's optimizer must share with the live
    ones (``load_state_dict`` would otherwise take another optimizer's state silently)."""
    return [type(optimizer).__name__] + [
        [sorted(k for k in group if k != "params"), len(group["params"])]
        for group in optimizer.param_groups]


def pack_state(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> torch.Tensor:
    """The state as a uint8 tensor."""
    buffer = io.BytesIO()
    torch.save({"signature": signature(model), "optimizer_signature":
                optimizer_signature(optimizer), "model": model.state_dict(),
                "optimizer": optimizer.state_dict(), "step": step}, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def unpack_state(payload: torch.Tensor, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> int:
    """Load a packed state into ``model`` and ``optimizer``; return its step. A ValueError
    names the first parameter that differs when the sender trains another model."""
    state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
    mine = signature(model)
    theirs = [tuple(x) if not isinstance(x, list) else x for x in state["signature"]]
    theirs = [(n, tuple(s), d) for n, s, d in theirs]
    if theirs != mine:
        diff = next(((a, b) for a, b in zip(mine, theirs) if a != b), (mine[len(theirs):],
                                                                        theirs[len(mine):]))
        raise ValueError(f"cannot rejoin: the live replicas train another model (here "
                         f"{diff[0]}, there {diff[1]})")
    ours, sent = optimizer_signature(optimizer), state.get("optimizer_signature")
    if sent is not None and sent != ours:
        here, there = (ours[0], sent[0]) if ours[0] != sent[0] else (
            f"{ours[0]} groups {ours[1:]}", f"groups {sent[1:]}")
        raise ValueError(f"cannot rejoin: the live replicas use another optimizer (here "
                         f"{here}, there {there})")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"]


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 over every parameter, buffer and optimizer-state tensor (their bytes, in
    order) and the optimizer's hyperparameters: equal digests, bit-identical states."""
    digest = hashlib.sha256()
    tensors = list(model.state_dict().items())
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        tensors += [(f"{index}.{key}", t) for key, t in sorted(state.items())
                    if isinstance(t, torch.Tensor)]
    for name, t in tensors:
        digest.update(name.encode())
        digest.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    groups = [{k: v for k, v in g.items() if k != "params"}
              for g in optimizer.state_dict()["param_groups"]]
    digest.update(repr(groups).encode())
    return digest.hexdigest()
