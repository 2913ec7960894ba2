"""The checks of ``engine train``'s options that need more than a range: PyTorch's side
(:func:`check_torch`) and checkpointing and the lab's failure injection
(:func:`check_checkpointing`). Each raises a ValueError naming the flag, before any rank
starts; :func:`engine.train.check_config` calls them.
"""

from __future__ import annotations

from engine.moe.gpt import MOE_MODELS
from engine.validation import non_negative_int, positive_int, positive_number


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
    positive_number("--timeout", cfg.timeout)
    positive_int("--keep", cfg.keep)
    if cfg.save_every is not None:
        positive_int("--save-every (steps between checkpoints)", cfg.save_every)
    for flag, value in (("--save-every", cfg.save_every), ("--resume", cfg.resume),
                        ("--reshard", cfg.reshard),
                        ("--async-save", getattr(cfg, "async_save", False))):
        if value is not None and value is not False and cfg.save is None:
            raise ValueError(f"{flag} needs --save DIR, the directory of the run's checkpoints")
    if cfg.reshard and not cfg.resume:
        raise ValueError("--reshard re-cuts the checkpoint --resume loads: pass --resume too")
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
