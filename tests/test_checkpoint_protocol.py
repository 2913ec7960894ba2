"""The checkpoint failure protocol (engine.checkpoint.protocol): an exception on one rank during a
save or a load, while that rank's process lives on, reaches every rank at once as a
CheckpointError naming that rank and the cause; no checkpoint that looks complete is left
behind; and every process goes on to run collectives (and checkpoints) afterwards. On the
per-rank format (engine.checkpoint.per_rank), the engine's one: of ranks holding different
parameters, and of ranks holding ZeRO-2 shards (the composed engine's rank state,
engine.compose.resume, which is what engine train saves).

Faults are injected on one rank only, inside the rank function: ``torch.save`` or
``torch.load`` raising (serialising), ``os.fsync`` failing as on a full disk (writing), rank
0's rename of the manifest failing (the last write), ``Path.read_bytes`` failing (reading) and
one rank's own file corrupted (verifying). Each launch runs all the faults of one kind of
rank state and one direction in turn, so the ranks of one process group live through all of
them: world size 2, tiny models, a few seconds in all.
"""

from __future__ import annotations

import errno
import os
import re
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from engine.checkpoint import (MANIFEST, CheckpointError, load_per_rank, read_rank_state,
                               save_per_rank)
from engine.compose.loop import train_step
from engine.compose.model import GPT, ModelConfig
from engine.compose.parallelize import Parallel, parallelize
from engine.compose.plan import Plan
from engine.compose.resume import rank_state
from engine.model.data import global_batch
from tests.helpers import run_ranks

REACHES_EVERY_RANK_S = 15  # the acceptance bound; measured: well under a second
PROCESS_GROUP_TIMEOUT_S = 20  # a rank left waiting would raise only after this


@contextmanager
def patched(owner, name: str, replacement):
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield original
    finally:
        setattr(owner, name, original)


def _raise(error: Exception):
    def fail(*args, **kwargs):
        raise error
    return fail


def _fails_to_rename_the_manifest(original):
    def replace(source, target, *args, **kwargs):
        if Path(target).name == MANIFEST:
            raise OSError(errno.EIO, "Input/output error (injected)", str(target))
        return original(source, target, *args, **kwargs)
    return replace


@contextmanager
def _corrupted(path: Path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 1])
                     + data[len(data) // 2 + 1:])
    try:
        yield
    finally:
        path.write_bytes(data)


# fault -> (the rank it strikes, what it says, a context manager injecting it there)
SAVE_FAULTS = {
    "serialise": (1, "torch.save failed (injected)", lambda directory, rank: patched(
        torch, "save", _raise(RuntimeError("torch.save failed (injected)")))),
    "write": (1, "No space left on device", lambda directory, rank: patched(
        os, "fsync", _raise(OSError(errno.ENOSPC, "No space left on device")))),
    "manifest": (0, "Input/output error (injected)", lambda directory, rank: patched(
        os, "replace", _fails_to_rename_the_manifest(os.replace))),
}
LOAD_FAULTS = {
    "read": (1, "Input/output error (injected)", lambda directory, rank: patched(
        Path, "read_bytes", _raise(OSError(errno.EIO, "Input/output error (injected)")))),
    "deserialise": (1, "torch.load failed (injected)", lambda directory, rank: patched(
        torch, "load", _raise(RuntimeError("torch.load failed (injected)")))),
    "verify": (1, "is corrupted: its SHA-256 does not match the manifest",
               lambda directory, rank: _corrupted(directory / f"rank{rank}-of2.pt")),
}


# -- two kinds of rank state, on tiny models ---------------------------------------------------


TINY = ModelConfig(vocab=16, seq_len=4, layers=1, heads=2, hidden=8)


def _zero2(rank, seed):
    """A composed rank of dp2 ZeRO-2 (its optimizer state a shard of each bucket), saved as
    engine train saves it: its rank state (engine.compose.resume)."""
    plan = Plan(dp=2, zero=2)
    par = parallelize(GPT(TINY, seed=seed), plan.mesh(), plan, torch.optim.AdamW, lr=0.1)
    return par, None


def _different(rank, seed):
    torch.manual_seed(seed + rank)
    model = nn.Linear(4, 3 + rank)  # the ranks hold different parameters
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _save(directory, model, optimizer):
    save_per_rank(directory, *(rank_state(model) if optimizer is None else (model, optimizer)))


def _load(directory, model, optimizer):
    load_per_rank(directory, *(rank_state(model) if optimizer is None else (model, optimizer)))


KINDS = {"zero2": (_zero2, _save, _load), "different": (_different, _save, _load)}


def _step(model, optimizer):
    if isinstance(model, Parallel):
        train_step(model, global_batch(0, 4, TINY.seq_len, TINY.vocab, 1))
        return
    model(torch.ones(2, 4)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _params(model):
    held = model.model if isinstance(model, Parallel) else model
    return torch.cat([p.detach().reshape(-1).clone() for p in held.parameters()])


def _everyone_still_answers(rank, world_size) -> bool:
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return total.item() == world_size * (world_size + 1) / 2


def _attempt(action, fault, directory, rank):
    """``action()`` under ``fault`` (on its rank): the CheckpointError every rank raised and
    how long it took to reach this rank, measured from a point all ranks passed together."""
    struck, _, inject = fault
    dist.barrier()
    started = time.perf_counter()
    try:
        if rank == struck:
            with inject(directory, rank):
                action()
        else:
            action()
    except CheckpointError as e:
        return str(e), time.perf_counter() - started
    return None, time.perf_counter() - started


def _faulty_saves(rank, world_size, kind, root):
    build, save, _ = KINDS[kind]
    model, optimizer = build(rank, seed=0)
    _step(model, optimizer)
    results = {}
    for name, fault in SAVE_FAULTS.items():
        directory = Path(root) / name
        message, seconds = _attempt(lambda: save(directory, model, optimizer), fault,
                                    directory, rank)
        results[name] = (message, seconds, _everyone_still_answers(rank, world_size))
    save(Path(root) / "afterwards", model, optimizer)  # and checkpoints still work
    return results


def _faulty_loads(rank, world_size, kind, root):
    build, save, load = KINDS[kind]
    directory = Path(root)
    model, optimizer = build(rank, seed=0)
    _step(model, optimizer)
    save(directory, model, optimizer)
    fresh, fresh_optimizer = build(rank, seed=7)
    before = _params(fresh)
    results = {}
    for name, fault in LOAD_FAULTS.items():
        message, seconds = _attempt(lambda: load(directory, fresh, fresh_optimizer), fault,
                                    directory, rank)
        results[name] = (message, seconds, _everyone_still_answers(rank, world_size),
                         torch.equal(_params(fresh), before))  # no rank loaded anything
    load(directory, fresh, fresh_optimizer)  # and the checkpoint loads once the fault is gone
    results["afterwards"] = torch.equal(_params(fresh), _params(model))
    return results


def _check(results: list[dict], faults: dict, verb: str) -> None:
    for name, (struck, cause, _) in faults.items():
        for rank, found in enumerate(results):
            message, seconds, answers = found[name][:3]
            assert message is not None, f"{name}: rank {rank} raised no CheckpointError"
            own = rf"rank {struck} could not {verb} \S+: "
            expected = own if rank == struck else rf"rank {struck} cannot {verb}: {own}"
            assert re.match(expected, message), (name, rank, message)
            assert cause in message, (name, rank, message)
            assert seconds < REACHES_EVERY_RANK_S, (name, rank, seconds)
            assert answers, f"{name}: rank {rank}'s all_reduce after the failure"


def _not_complete(directory: Path) -> None:
    """No manifest, no temporary file; a save that failed while serialising made no
    directory at all."""
    assert not (directory / MANIFEST).exists()
    if directory.exists():
        assert not [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]
    with pytest.raises(CheckpointError, match="manifest.json does not exist"):
        read_rank_state(directory, 0)


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_save_on_one_rank_reaches_every_rank(kind, tmp_path):
    results = run_ranks(_faulty_saves, 2, kind, tmp_path, timeout=PROCESS_GROUP_TIMEOUT_S)
    _check(results, SAVE_FAULTS, "save")
    for name in SAVE_FAULTS:
        _not_complete(tmp_path / name)
    assert (tmp_path / "afterwards" / MANIFEST).exists()


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_load_on_one_rank_reaches_every_rank(kind, tmp_path):
    results = run_ranks(_faulty_loads, 2, kind, tmp_path, timeout=PROCESS_GROUP_TIMEOUT_S)
    _check(results, LOAD_FAULTS, "load")
    for rank, found in enumerate(results):
        assert all(found[name][3] for name in LOAD_FAULTS), f"rank {rank} loaded a part"
        assert found["afterwards"], rank


def _resave_that_cannot_serialise(rank, world_size, kind, root):
    build, save, load = KINDS[kind]
    directory = Path(root)
    model, optimizer = build(rank, seed=0)
    _step(model, optimizer)
    save(directory, model, optimizer)  # a good checkpoint
    saved = _params(model)
    _step(model, optimizer)  # the run goes on; its next save into the same place fails
    message, _ = _attempt(lambda: save(directory, model, optimizer), SAVE_FAULTS["serialise"],
                          directory, rank)
    fresh, fresh_optimizer = build(rank, seed=7)
    load(directory, fresh, fresh_optimizer)
    return message, torch.equal(_params(fresh), saved)


@pytest.mark.parametrize("kind", KINDS)
def test_a_save_that_cannot_serialise_leaves_the_earlier_checkpoint_whole(kind, tmp_path):
    """Serialising is agreed before the old manifest is removed: a rank that cannot serialise
    its state costs nothing already on disk (the old manifest, its files, still loadable)."""
    results = run_ranks(_resave_that_cannot_serialise, 2, kind, tmp_path,
                        timeout=PROCESS_GROUP_TIMEOUT_S)
    for rank, (message, loaded_the_earlier) in enumerate(results):
        assert message is not None and "torch.save failed (injected)" in message, message
        assert loaded_the_earlier, f"rank {rank} could not load the earlier checkpoint"


def failure_latencies(tmp_path) -> dict:
    """The slowest rank's time from the fault to its CheckpointError, per kind, direction and
    fault (for the record: ``python -c 'from tests.test_checkpoint_protocol import *; ...'``)."""
    out = {}
    for kind in KINDS:
        for verb, fn in (("save", _faulty_saves), ("load", _faulty_loads)):
            results = run_ranks(fn, 2, kind, Path(tmp_path) / kind / verb)
            faults = SAVE_FAULTS if verb == "save" else LOAD_FAULTS
            out[kind, verb] = {name: max(r[name][1] for r in results) for name in faults}
    return out
