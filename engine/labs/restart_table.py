"""Restart against rejoin: the wall time a run loses when one replica group dies, measured both
ways on the same model (the tiny GPT) and the same six ranks.

* **Restart everyone from the last checkpoint** (chapter 07's path, the one torchrun with
  ``--max-restarts`` takes): ``torchrun --nproc-per-node 6 --max-restarts 1 -m engine train
  --dp 6 --save DIR --save-every K --resume --kill-at-step k``. One rank is SIGKILLed after
  step ``k``; torchrun stops every worker, starts all six again (new processes: Python, torch,
  a new rendezvous), they load the newest checkpoint and redo the steps done since it. Lost:
  the killed run's wall time less the same command's with no kill.
* **Live rejoin** (:mod:`engine.ft`, torchft's design): three replica groups of two ranks
  (:func:`engine.ft.run_with_failure`); group 2 is SIGKILLed mid-step ``k``; the survivors
  abort that round and redo it without it (no restart, nothing reloaded), and the group,
  restarted, rejoins from a live peer's memory. Lost by the survivors: their failed step less
  a healthy one (:attr:`~engine.ft.harness.FailureRun.lost_seconds`); the rejoining group's
  own restart (``rejoin_seconds``) overlaps the survivors' training.

The restart's loss grows with the time since the last checkpoint and with the job's start-up
time; the rejoin's is about one quorum deadline. Both are wall-clock measurements of real
processes on this machine, not a model: :func:`restart_vs_rejoin` runs them (about two minutes
on a 2-core CPU) and :func:`print_restart_vs_rejoin` prints the table.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine.ft.harness import run_with_failure
from engine.model.gpt import GPTConfig, TinyGPT
from engine.model.data import token_data

# engine train's "tiny" preset (engine.model.presets.MODELS), kept here as numbers: the ft layer
# does not import the training layer; engine train is run as a command
TINY = GPTConfig(vocab=64, seq_len=16, layers=2, heads=4, hidden=32)
SEQUENCES_PER_RANK = 8  # engine train's default: 2 micro-batches of 4


def tiny_gpt() -> TinyGPT:
    return TinyGPT(TINY, seed=0)


def adamw(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def token_loss(model, step: int, rank: int) -> torch.Tensor:
    idx, targets = token_data(SEQUENCES_PER_RANK, TINY.seq_len, TINY.vocab,
                              seed=1000 * step + rank)
    return model.loss(idx, targets)


def torchrun_seconds(directory: Path, steps: int, save_every: int, kill_step: int | None,
                     ranks: int = 6, timeout_s: float = 600) -> float:
    """Wall seconds of ``torchrun ... -m engine train`` on ``ranks`` CPU ranks (DDP, the tiny
    GPT), killed after ``kill_step`` and restarted once when it is given."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(ranks), "--max-restarts", "1", "-m", "engine", "train",
               "--dp", str(ranks), "--zero", "0", "--model", "tiny", "--steps", str(steps),
               "--save", str(directory), "--save-every", str(save_every), "--resume"]
    if kill_step is not None:
        command += ["--kill-at-step", str(kill_step)]
    # each torchrun attempt its own rendezvous store (engine.launch.elastic.check_restartable)
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    began = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"torchrun failed ({done.returncode}): {done.stderr[-2000:]}")
    return seconds


def restart_vs_rejoin(steps: int = 12, kill_step: int = 5, save_every: int = 4) -> dict:
    """Both ways, on 6 ranks and the tiny GPT: one failure after (or during) step
    ``kill_step``, checkpoints every ``save_every`` steps for the restart. Seconds."""
    with tempfile.TemporaryDirectory() as root:
        healthy = torchrun_seconds(Path(root, "healthy"), steps, save_every, None)
        killed = torchrun_seconds(Path(root, "killed"), steps, save_every, kill_step)
    run = run_with_failure(tiny_gpt, adamw, token_loss, replicas=3, steps=steps,
                           kill=(2, kill_step), restart_after=2, deadline_s=2.0,
                           timeout_s=5.0, group_size=2, run_timeout_s=180)
    redone = kill_step - (kill_step // save_every) * save_every
    return {"restart": {"healthy_s": healthy, "failed_s": killed, "lost_s": killed - healthy,
                        "steps_redone": redone},
            "rejoin": {"step_s": run.step_seconds, "failed_step_s": run.failed_step_seconds,
                       "lost_s": run.lost_seconds, "rejoin_s": run.rejoin_seconds,
                       "rejoined_step": run.rejoined_step, "wall_s": run.wall_seconds},
            "steps": steps, "kill_step": kill_step, "save_every": save_every}


def print_restart_vs_rejoin(result: dict) -> None:
    restart, rejoin = result["restart"], result["rejoin"]
    print(f"one replica group lost at step {result['kill_step']} of {result['steps']}, "
          f"6 CPU ranks, the tiny GPT")
    print(f"{'':34} {'wall time lost (s)':>19}")
    print(f"{'restart everyone from checkpoint':34} {restart['lost_s']:>19.1f}   "
          f"(run {restart['failed_s']:.1f} s against {restart['healthy_s']:.1f} s healthy; "
          f"{restart['steps_redone']} step(s) redone since the checkpoint)")
    print(f"{'live rejoin (engine.ft)':34} {rejoin['lost_s']:>19.1f}   "
          f"(failed step {rejoin['failed_step_s']:.2f} s against {rejoin['step_s']:.2f} s; "
          f"the group rejoined at step {rejoin['rejoined_step']}, "
          f"{rejoin['rejoin_s']:.1f} s after its restart)")


if __name__ == "__main__":
    print_restart_vs_rejoin(restart_vs_rejoin())
