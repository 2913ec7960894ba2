"""The checks of ``engine train``'s options that need more than a type: PyTorch's side
(:func:`check_torch`), checkpointing, the seed, the timeout and the lab's failure injection
(:func:`check_checkpointing`), the batch's size (:func:`check_batch`), the data and the
vocabulary (:func:`check_data`), the ranks this machine can run (:func:`check_world`) and the
folders the run writes to (:func:`check_paths`). Each
raises a ValueError naming the flag, the value given and what was expected, before any rank
starts; :func:`engine.train.cli.check_config` and :func:`engine.train.cli.main` call them.

The bounds, and why each is one:

* ``--timeout``: 1 s to a day (:data:`MIN_TIMEOUT_S`, :data:`MAX_TIMEOUT_S`). The ranks'
  rendezvous waits as long, and below a second it may not finish (at 1e-6 s the launch's
  store never starts); at 1e20 s ``timedelta`` overflows, and a collective that waits more
  than a day for a peer has lost it.
* ``--seed``: 0 to 2**32 - 1 (:data:`MAX_SEED`): the data's generator is seeded with
  ``(seed + 1) x 1,000,003 + step`` (:func:`engine.model.data.global_batch`), which
  ``torch.Generator.manual_seed`` takes only below 2**64.
* ``--micro-batch``: at most 2**20 tokens in one micro-batch (:data:`MAX_MICRO_BATCH_TOKENS`,
  sequences x ``--model``'s sequence length); ``--microbatches``: a global batch (dp x
  microbatches x micro-batch sequences) of at most 2**24 tokens
  (:data:`MAX_GLOBAL_BATCH_TOKENS`, about Llama 3 405B's largest, 16M), because every rank
  draws the *whole* global batch of each step (:mod:`engine.compose.data`).
* ``--data PATH``: a token file with its sidecar (:mod:`engine.model.tokens`), at least
  ``seq_len + 1`` tokens long, whose vocabulary fits the model's (``--vocab``, else
  ``--model``'s; ``--vocab`` 2 to 2**20, :data:`MAX_VOCAB`); not with ``--varlen`` (the
  synthetic chain's packed documents) nor ``--impl torch`` / ``both`` (PyTorch's side draws
  the synthetic chain).
* the world, dp x cp x tp x pp, on Gloo (CPU ranks, forked here): at most
  :data:`RANKS_PER_CORE` ranks per core this process may use, and never fewer than
  :data:`MIN_RANK_LIMIT` (the course's largest CPU layout, 2 x 2 x 2, runs on any machine);
  ``--allow-oversubscribe`` lifts it. On NCCL every rank needs a GPU of its own
  (:func:`engine.launch.resolve_backend` refuses more); under torchrun the world is
  torchrun's, not limited here.
* ``--save DIR`` and ``--trace PATH``: a file is created (and removed) in the folder they
  write to, so a missing folder, a read-only one, a path through a file or ``/proc`` is
  refused now, not at the first save or after the last step. ``--save``'s folder is created
  with its parents at the first save, so the nearest existing folder above it is tried.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from engine.moe.gpt import MOE_MODELS
from engine.model.presets import MODELS
from engine.model.tokens import check_tokens, read_meta
from engine.validation import at_least, at_most, non_negative_int, positive_int, \
    positive_number

MIN_TIMEOUT_S = 1.0
MAX_TIMEOUT_S = 86_400.0  # a day
MAX_SEED = 2**32 - 1
MAX_MICRO_BATCH_TOKENS = 2**20
MAX_GLOBAL_BATCH_TOKENS = 2**24
MAX_VOCAB = 2**20
RANKS_PER_CORE = 4
MIN_RANK_LIMIT = 8


def check_torch(cfg) -> None:
    """``--impl torch`` / ``both``: PyTorch's wrappers compare data parallelism on the dense
    GPT; its compression hooks are fp16 and bf16 only."""
    for flag, value in (("--cp", cfg.cp), ("--ep", cfg.ep), ("--tp", cfg.tp), ("--pp", cfg.pp)):
        if value != 1:
            raise ValueError(f"--impl {cfg.impl} compares data-parallel configurations (DDP, "
                             f"ZeroRedundancyOptimizer or FSDP by --zero): it needs {flag} 1, "
                             f"got {flag} {value}; use --impl engine")
    if cfg.model in MOE_MODELS:
        raise ValueError(f"--impl {cfg.impl} --model {cfg.model}: PyTorch's wrappers compare "
                         "the dense GPT; train the MoE model with --impl engine")
    if cfg.compress is None:
        return
    if cfg.compress.split(":")[0] in ("topk", "randomk"):
        raise ValueError(f"--impl {cfg.impl} --compress {cfg.compress}: PyTorch has no "
                         "DDP hook for Top-K or Random-K; use --impl engine")
    if cfg.compress.startswith("powersgd"):
        # measured with torch 2.13 on Gloo, --model small: with no_sync accumulation, or
        # after the engine's run in the same launch, the ranks' collectives stopped
        # matching ("Received data size doesn't match expected size") and a rank aborted
        raise ValueError(f"--impl {cfg.impl} --compress {cfg.compress}: PyTorch's "
                         "powerSGD_hook desynchronised the ranks in this trainer (torch "
                         "2.13, Gloo); compare PowerSGD with --impl engine, or fp16/bf16 "
                         "with --impl both")


def check_checkpointing(cfg) -> None:
    """--seed, --timeout, --save/--save-every/--keep/--async-save/--resume/--reshard and the
    lab's kill."""
    non_negative_int("--seed", cfg.seed)
    at_most("--seed", cfg.seed, MAX_SEED, " (2**32 - 1: the data's generator is seeded with "
            "(seed + 1) x 1,000,003 + step, which torch takes only below 2**64)")
    positive_number("--timeout", cfg.timeout)
    at_least("--timeout", cfg.timeout, MIN_TIMEOUT_S, " second (below that a process group "
             "may not even form)")
    at_most("--timeout", cfg.timeout, MAX_TIMEOUT_S, " seconds (a day: a collective that "
            "waits longer for a peer has lost it)")
    positive_int("--keep", cfg.keep)
    if cfg.save_every is not None:
        positive_int("--save-every (steps between checkpoints)", cfg.save_every)
    for flag, value in (("--save-every", cfg.save_every), ("--resume", cfg.resume),
                        ("--reshard", cfg.reshard),
                        ("--async-save", getattr(cfg, "async_save", False)),
                        ("--resume-fallback", getattr(cfg, "resume_fallback", False))):
        if value is not None and value is not False and cfg.save is None:
            raise ValueError(f"{flag} needs --save DIR, the directory of the run's checkpoints")
    if cfg.reshard and not cfg.resume:
        raise ValueError("--reshard re-cuts the checkpoint --resume loads: pass --resume too")
    if getattr(cfg, "resume_fallback", False) and not cfg.resume:
        raise ValueError("--resume-fallback chooses the checkpoint --resume loads: pass "
                         "--resume too")
    if cfg.save is not None and cfg.impl != "engine":
        raise ValueError(f"--save writes the engine's per-rank checkpoints (every layout, "
                         f"--compress included); PyTorch's wrappers save none here: use "
                         f"--impl engine, not --impl {cfg.impl}")
    if cfg.kill_at_step is not None:
        positive_int("--kill-at-step", cfg.kill_at_step)
    if cfg.kill_rank is not None and not 0 <= non_negative_int("--kill-rank", cfg.kill_rank) \
            < cfg.world_size:
        raise ValueError(f"--kill-rank {cfg.kill_rank} is not a rank of this run (0 to "
                         f"{cfg.world_size - 1})")


def check_batch(cfg) -> None:
    """``--micro-batch`` and ``--microbatches`` against the tokens a micro-batch and a
    global batch may hold (module docstring); ``--model`` must be checked already."""
    seq = MODELS[cfg.model].seq_len
    if cfg.micro_batch * seq > MAX_MICRO_BATCH_TOKENS:
        raise ValueError(f"--micro-batch {cfg.micro_batch}: {cfg.micro_batch:,} sequences of "
                         f"{seq} tokens (--model {cfg.model}) are more than the "
                         f"{MAX_MICRO_BATCH_TOKENS:,} tokens (2**20) a micro-batch may hold; "
                         f"expected --micro-batch at most {MAX_MICRO_BATCH_TOKENS // seq:,}")
    tokens = cfg.dp * cfg.microbatches * cfg.micro_batch * seq
    if tokens > MAX_GLOBAL_BATCH_TOKENS:
        most = max(1, MAX_GLOBAL_BATCH_TOKENS // (cfg.dp * cfg.micro_batch * seq))
        raise ValueError(f"--microbatches {cfg.microbatches}: a global batch of dp x "
                         f"microbatches x micro-batch = {cfg.dp} x {cfg.microbatches} x "
                         f"{cfg.micro_batch} sequences of {seq} tokens is {tokens:,} tokens, "
                         f"more than the {MAX_GLOBAL_BATCH_TOKENS:,} (2**24) every rank can "
                         f"draw each step; expected --microbatches at most {most:,} here")


def check_data(cfg) -> None:
    """``--vocab`` and ``--data`` (module docstring); ``--model`` must be checked already."""
    vocab = MODELS[cfg.model].vocab
    if cfg.vocab is not None:
        vocab = at_least("--vocab", positive_int("--vocab", cfg.vocab), 2,
                         " (a next-token loss needs two tokens to choose from)")
        at_most("--vocab", vocab, MAX_VOCAB, " (4 x Gemma 3's 262,144, among the largest "
                "published vocabularies)")
    if cfg.data is None:
        return
    if cfg.varlen:
        raise ValueError(f"--varlen packs the synthetic chain's documents with padding; --data "
                         f"{cfg.data} trains on windows of its text, none padded: expected one "
                         "of them, not both")
    try:
        meta = read_meta(cfg.data)
    except ValueError as e:
        raise ValueError(f"--data {e}") from None
    if meta["vocab"] > vocab and cfg.vocab is not None:
        raise ValueError(f"--vocab {cfg.vocab} is less than the vocabulary of --data "
                         f"{cfg.data}, {meta['vocab']:,} (tokenizer {meta.get('tokenizer')}); "
                         f"expected --vocab {meta['vocab']} or more")
    try:
        check_tokens(cfg.data, MODELS[cfg.model].seq_len, vocab, model=f"--model {cfg.model}",
                     hint=f": pass --vocab {meta['vocab']}")
    except ValueError as e:
        raise ValueError(f"--data {e}") from None


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity: a container's or taskset's
    share), else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def rank_limit() -> int:
    """The most Gloo ranks ``engine train`` forks on this machine without
    ``--allow-oversubscribe`` (module docstring)."""
    return max(MIN_RANK_LIMIT, RANKS_PER_CORE * usable_cores())


def check_world(cfg, world: int, backend: str, under_torchrun: bool) -> None:
    """The ranks of a local launch against this machine: on Gloo at most :func:`rank_limit`
    unless ``--allow-oversubscribe`` (NCCL's one GPU per rank is checked by
    :func:`engine.launch.resolve_backend`; torchrun's world is not limited here)."""
    if under_torchrun or backend != "gloo" or getattr(cfg, "allow_oversubscribe", False):
        return
    limit = rank_limit()
    if world > limit:
        raise ValueError(f"--dp {cfg.dp} --cp {cfg.cp} --tp {cfg.tp} --pp {cfg.pp}: "
                         f"{world:,} ranks, each a process forked on this machine, and it "
                         f"runs at most {limit:,} ({RANKS_PER_CORE} per core x "
                         f"{usable_cores()} core(s), at least {MIN_RANK_LIMIT}); expected a "
                         "smaller layout, torchrun across machines, or --allow-oversubscribe "
                         "to launch them anyway")


def check_paths(cfg, trace: bool = True) -> None:
    """``--save DIR`` and (with ``trace``: only global rank 0 writes it) ``--trace PATH``
    are writable: a file is made and removed where each will write (module docstring)."""
    if cfg.save is not None:
        folder = Path(cfg.save)
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"--save {cfg.save}: it is a file, expected a folder for the "
                             "checkpoints (or a path where one can be made)")
        nearest = folder
        while not nearest.exists() and nearest != nearest.parent:
            nearest = nearest.parent
        _writable("--save", cfg.save, nearest, "the checkpoints' folder" if nearest == folder
                  else "the nearest existing folder above it, where it would be made")
    if trace and cfg.trace is not None:
        path = Path(cfg.trace)
        if path.is_dir():
            raise ValueError(f"--trace {cfg.trace}: it is a folder, expected the path of the "
                             f"trace file to write (e.g. {path / 'trace.json'})")
        parent = path.parent
        if not parent.exists():
            raise ValueError(f"--trace {cfg.trace}: the folder {parent} does not exist, "
                             "expected an existing folder (make it first)")
        _writable("--trace", cfg.trace, parent, "the trace's folder")
        if path.exists() and not os.access(path, os.W_OK):
            raise ValueError(f"--trace {cfg.trace}: the file exists and is read-only, "
                             "expected a path the trace can be written to")


def _writable(flag: str, value: str, folder: Path, what: str) -> None:
    """A ValueError naming ``flag`` unless a file can be made (then removed) in ``folder``."""
    if not folder.is_dir():
        raise ValueError(f"{flag} {value}: {folder} is a file, expected a folder "
                         f"({what})")
    try:
        handle, probe = tempfile.mkstemp(prefix=".engine-train-write-check-", dir=folder)
    except OSError as e:
        raise ValueError(f"{flag} {value}: no file can be made in {folder} ({what}): "
                         f"{e.strerror or e}; expected a folder this user can write to"
                         ) from None
    os.close(handle)
    os.unlink(probe)
