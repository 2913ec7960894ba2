"""How ``python -m engine train`` ends when it does not train to its last step: one line that
says what happened and what to do next, instead of a traceback.

* **Ctrl-C** (:func:`interrupted`): ``stopped by Ctrl-C after step 7 of 100; the newest
  complete checkpoint: DIR/step-00000005; resume with: python -m engine train ... --resume``,
  exit code 130 (a shell's for SIGINT). The step comes from the file global rank 0 rewrites
  after each step (:class:`engine.train.run.Progress`).
* **A lost peer** under torchrun (:func:`lost_peer`): each surviving rank prints the one
  :class:`engine.launch.elastic.PeerLostError` line, which names the ranks that are gone, and the
  log file where it wrote the full traceback; torchrun's failure summary shows the same line.
* **The lab's kill** (``--kill-at-step K`` outside torchrun, :func:`killed_on_purpose`): the
  rank killed on purpose, at which step, what an elastic run would do instead and the command
  that resumes here; exit code 137 (a shell's for SIGKILL, as the killed rank got). Any other
  death of a rank keeps its ``RankDiedError`` traceback.
* **A refused start** (``--save DIR`` already holds checkpoints, a bad flag) and **nothing to
  do** (``--resume`` from a checkpoint that holds every step): one line on the console, and
  under torchrun in the agent's failure summary too (:func:`tell_torchrun`).
* **A run that stopped itself** (:func:`stopped`): a loss that is not finite
  (:mod:`engine.train.nonfinite`: the step, the first rank and layer with a non-finite output,
  the newest checkpoint), exit code 1 (:data:`NONFINITE_EXIT`); a checkpoint ``--resume``
  could not load (a rank file missing or failing its SHA-256, named with its rank), exit code
  2 (:data:`REFUSED_EXIT`, a refused start's). Every rank stops at the same point, so no
  rank is left waiting; the line, not a traceback.
"""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
import time
import traceback

from engine.checkpoint import trainer as checkpoints
from engine.launch import LaunchEnv

INTERRUPTED_EXIT = 130  # what a shell reports for a process ended by SIGINT
KILLED_EXIT = 137  # what a shell reports for a process ended by SIGKILL (128 + 9)
NONFINITE_EXIT = 1  # the loss stopped being finite
REFUSED_EXIT = 2  # a refused start: a bad flag, a checkpoint that cannot be resumed
# what engine.launch.elastic.kill_point prints on the rank it is about to kill
KILL_SAID = "killed by --kill-at-step"
# flags a resumed run drops: the lab's kill would strike again outside torchrun
ONE_SHOT_FLAGS = ("--kill-at-step", "--kill-rank")


def read_step(step_file: str | None) -> int | None:
    """The last step global rank 0 finished, from its step file (None: none yet)."""
    if step_file is None:
        return None
    try:
        with open(step_file) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def resume_command(argv: list[str], under_torchrun: bool) -> str:
    """The command that continues this run from its newest checkpoint."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in ONE_SHOT_FLAGS:
            skip = True
            continue
        if arg.split("=", 1)[0] not in ONE_SHOT_FLAGS:
            kept.append(arg)
    if "--resume" not in kept:
        kept.append("--resume")
    if under_torchrun:
        return "the same torchrun command, with: -m engine train " + shlex.join(kept)
    return "python -m engine train " + shlex.join(kept)


def interrupted(cfg, argv: list[str], step: int | None, under_torchrun: bool = False) -> str:
    """The line printed on Ctrl-C: the step reached, the newest complete checkpoint, and the
    command that resumes (or, without ``--save``, that nothing can be resumed)."""
    where = f"after step {step} of {cfg.steps}" if step else \
        f"before its first step (of {cfg.steps})"
    if cfg.save is None:
        return (f"stopped by Ctrl-C {where}; no checkpoint (this run had no --save DIR), so "
                "a new run starts at step 1")
    newest = checkpoints.latest(cfg.save)
    if newest is None:
        return (f"stopped by Ctrl-C {where}; no complete checkpoint in {cfg.save} yet; "
                f"start again with: {resume_command(argv, under_torchrun)}")
    return (f"stopped by Ctrl-C {where}; the newest complete checkpoint: {newest}; resume "
            f"with: {resume_command(argv, under_torchrun)}")


def killed_on_purpose(error: BaseException, cfg, world: int, argv: list[str]) -> str | None:
    """What a local run (no torchrun) says when ``error`` is the lab's own kill: a
    :class:`~engine.launch.RankDiedError` of the rank ``--kill-rank`` names (default: the last),
    killed by SIGKILL after saying so. None for any other failure, which keeps its traceback."""
    from engine.launch import RankDiedError

    if cfg.kill_at_step is None or not isinstance(error, RankDiedError):
        return None
    rank = world - 1 if cfg.kill_rank is None else cfg.kill_rank
    said = error.outputs.get(rank, "")
    if error.ranks != [rank] or "by signal SIGKILL" not in str(error) or \
            f"rank {rank}: {KILL_SAID} {cfg.kill_at_step} " not in said:
        return None
    newest = checkpoints.latest(cfg.save) if cfg.save is not None else None
    if cfg.save is None:
        restart = "start over at step 1 (this run had no --save DIR, so no checkpoint)"
        here = "nothing to resume: a new run starts at step 1"
    elif newest is None:
        restart = f"start over at step 1 (no complete checkpoint in {cfg.save} yet)"
        here = f"start again with: {resume_command(argv, under_torchrun=False)}"
    else:
        restart = f"continue from the newest complete checkpoint, {newest}"
        here = f"resume here with: {resume_command(argv, under_torchrun=False)}"
    return (f"rank {rank} was killed on purpose by --kill-at-step {cfg.kill_at_step} (a lab "
            f"option), after step {cfg.kill_at_step} of {cfg.steps}; a local run has no agent "
            f"to restart it, so the run stopped (exit code {KILLED_EXIT}).\n"
            "Under torchrun with --max-restarts 1 or more and --resume (an elastic run: "
            "docs/lab.md, \"Elastic restarts\"), the agent would restart every rank and "
            f"{restart}; with per-step fault tolerance (chapter 11, engine.ft) the other "
            "replica groups would go on and the killed one rejoin from a live peer.\n"
            f"{here}")


def lost_peer(error: BaseException, rank: int) -> int:
    """Print ``error`` (a :class:`~engine.launch.elastic.PeerLostError`) as one line on stderr and
    write its full traceback to a log file the line names; tell torchrun the same line.
    Returns the exit code, 1."""
    with tempfile.NamedTemporaryFile("w", prefix=f"engine-train-rank{rank}-", suffix=".log",
                                     delete=False) as log:
        log.write("".join(traceback.format_exception(error)))
    line = f"rank {rank}: {type(error).__name__}: {error} (full traceback: {log.name})"
    print(line, file=sys.stderr, flush=True)
    tell_torchrun(line)
    return 1


def tell_torchrun(line: str) -> None:
    """Under torchrun, make the agent's failure summary show ``line`` for this worker (it
    reads the worker's error file), instead of a link to the docs."""
    path = LaunchEnv.read().error_file
    if path is None:
        return
    message = {"message": line, "extraInfo": {"py_callstack": line,
                                              "timestamp": str(int(time.time()))}}
    try:
        with open(path, "w") as f:
            json.dump({"message": message}, f)
    except OSError:
        pass  # the summary then shows torchrun's own text; the console has the line


def stopped(cfg, result: dict, rank_zero: bool) -> int:
    """A run whose ranks stopped together (``result``: this process's first rank's, with
    ``"stopped"``, the line, and ``"exit"``, the exit code): global rank 0 prints the line
    on stderr, with the newest complete checkpoint after a non-finite loss; under torchrun
    the agent's summary shows it too. Returns the exit code."""
    line = f"error: {result['stopped']}"
    if result["exit"] == NONFINITE_EXIT and cfg.save is not None:
        newest = checkpoints.latest(cfg.save)
        line += (f"; the newest complete checkpoint: {newest}" if newest is not None else
                 f"; no complete checkpoint in {cfg.save}")
    if rank_zero:
        print(line, file=sys.stderr, flush=True)
    tell_torchrun(line)
    return result["exit"]
