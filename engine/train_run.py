"""One ``engine train`` run on one rank: :func:`train_on_rank` builds each implementation's
strategy (:func:`engine.strategy.build`), works out the formulas the report prints
(:mod:`engine.train_formulas`) and runs it from step 0 or from a checkpoint, through the timed
steps (:func:`engine.timed_steps.run_steps`), with what a real run does after each step:

* the loss of the step, the mean over every counted token of its global batch (the step
  returns it on every rank), and a progress bar printed by global rank 0;
* a checkpoint every ``--save-every`` steps and after the last (:mod:`engine.checkpoints`);
* for labs and tests only, the kill of one rank at a chosen step (:func:`engine.elastic.
  kill_point`).

A run has ``--steps`` optimizer steps, numbered 1 to ``--steps`` and named so in its
checkpoints (``step-00000004`` after step 4). The first step of each launch is its warm-up:
it trains like every other, but is not timed (it counts the bytes instead). A run resumed
after ``k`` steps runs the other ``steps - k`` (the first of them the warm-up), each on its
step's global batch, so it computes exactly what the uninterrupted run computes from step
``k`` on: the loss curve and the final parameters are bit-identical on the CPU.

Which checkpoint to resume from, and whether it fits this run, is decided before any rank
starts (:func:`resume_point`); a checkpoint of another layout loads only with ``--reshard``,
which re-cuts it through the whole model (:mod:`engine.compose.reshard`). A checkpoint
written by the per-layout trainers this engine replaced is refused by name.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine import checkpoints
from engine.device import rank_device
from engine.elastic import Peers, kill_point, tell_how_nccl_loses_peers
from engine.steps import resolve_precision
from engine.strategy import build
from engine.timed_steps import StepsRun, run_steps
from engine.train_compose import check_composed_reshard, reshard_composed
from engine.topology import Mesh
from engine.trace import clock_offset, on_clock
from engine.train_formulas import composed_traffic_formulas, memory_formula

# what a checkpoint must agree with the run on: always, and (without --reshard) the layout
SAME_TRAINING = ("model", "seed", "lr", "precision")
SAME_LAYOUT = ("dp", "ep", "tp", "pp", "zero", "schedule", "microbatches", "micro_batch")
# the composed engine's (engine.train_compose) besides: a checkpoint written before they
# existed has their defaults
COMPOSED_LAYOUT = {"cp": 1, "cp_method": "ring-zigzag", "sequence_parallel": False,
                   "varlen": False, "engine": "per-layout"}
RESHARDED_COMPOSED = ("cp", "cp_method", "sequence_parallel")  # --reshard re-cuts them too
# (engine.compose.reshard)


@dataclass(frozen=True)
class ResumePoint:
    """A checkpoint to start from: its directory, the steps it holds, the loss of each, and
    whether it must be re-cut for this layout."""

    path: str
    step: int
    losses: list[float]
    reshard: bool = False


def total_steps(cfg) -> int:
    """The optimizer steps of the whole run: ``--steps``, the warm-up among them."""
    return cfg.steps


def resume_point(cfg) -> ResumePoint | None:
    """The checkpoint this run starts from (None: step 0), or a ValueError saying why the
    newest one in ``--save`` does not fit. Reads files only: call before any rank starts."""
    if cfg.save is None:
        return None
    path = checkpoints.latest(cfg.save)
    if not cfg.resume:
        if path is not None:
            raise ValueError(f"--save {cfg.save} already holds checkpoints (the newest: "
                             f"{path.name}); pass --resume to continue that run, or --save "
                             "an empty directory")
        return None
    if path is None:
        return None  # nothing saved yet: --resume on a first start (torchrun restarts alike)
    saved = checkpoints.read_trainer(path)
    config = saved["config"]
    for name in SAME_TRAINING:
        if config.get(name) != getattr(cfg, name):
            raise ValueError(f"--resume: {path} was saved by a run with --{_flag(name)} "
                             f"{config.get(name)}, this run has --{_flag(name)} "
                             f"{getattr(cfg, name)}; a resumed run keeps --model, --seed, "
                             "--lr and --precision (or --save a new directory)")
    if saved["step"] > total_steps(cfg):
        raise ValueError(f"--resume: {path} holds {saved['step']} steps, more than this run's "
                         f"{total_steps(cfg)} (--steps {cfg.steps})")
    changed = [name for name in SAME_LAYOUT if config.get(name) != getattr(cfg, name, None)]
    ours = composed_record(cfg)
    composed = [name for name, default in COMPOSED_LAYOUT.items()
                if config.get(name, default) != ours[name]]
    if cfg.reshard and config.get("engine") == ours["engine"] == "composed":
        changed += [name for name in composed if name in RESHARDED_COMPOSED]
        composed = [name for name in composed if name not in RESHARDED_COMPOSED]
    if composed:
        raise ValueError(f"--resume: {path} was saved with " + ", ".join(
            f"{name} {config.get(name, COMPOSED_LAYOUT[name])}" for name in composed) +
            ", this run has " + ", ".join(f"{name} {ours[name]}" for name in composed) +
            "; the composed engine resumes its own checkpoints on their own layout only")
    if changed and cfg.reshard:
        check_composed_reshard(config, cfg, path)  # refuses --compress, naming it
    if changed and not cfg.reshard:
        raise ValueError(f"--resume: {path} was saved at {_layout(config)}, this run asks for "
                         f"{_layout(vars(cfg))}; a sharded checkpoint fits only its own "
                         "layout: pass --reshard to re-cut it for this one (through the "
                         "whole model), or run with the saved layout")
    if changed and _global_batch(config) != _global_batch(vars(cfg)):
        raise ValueError(f"--resume --reshard: {path} trained on global batches of "
                         f"{_global_batch(config)} sequences (dp x microbatches x micro-batch),"
                         f" this run's are {_global_batch(vars(cfg))}; keep the global batch "
                         "(e.g. double --microbatches when you halve --dp)")
    return ResumePoint(str(path), saved["step"], saved["losses"], reshard=bool(changed))


def composed_record(cfg) -> dict:
    """What a checkpoint records of the composed engine's layout (:data:`COMPOSED_LAYOUT`)."""
    return {"cp": cfg.cp, "cp_method": cfg.cp_method,
            "sequence_parallel": cfg.sequence_parallel, "varlen": cfg.varlen,
            "engine": "composed"}


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _layout(config: dict) -> str:
    return (f"dp {config['dp']} x tp {config['tp']} x pp {config['pp']}"
            + (f" x ep {config['ep']}" if config.get("ep", 1) > 1 else "")
            + f", ZeRO-{config['zero']}, {config['microbatches']} micro-batches of "
            f"{config['micro_batch']}" + (f", {config['schedule']}" if config["pp"] > 1 else ""))


def _global_batch(config: dict) -> int:
    return config["dp"] * config["microbatches"] * config["micro_batch"]


# -- on every rank ------------------------------------------------------------------------------


def train_on_rank(rank: int, world_size: int, cfg, resume_from: ResumePoint | None = None,
                  progress_fd: int | None = None, name_lost_peers: bool = False,
                  step_file: str | None = None) -> dict:
    """Build each implementation's strategy, run the steps, return what the report needs.
    ``cfg``: an :class:`engine.train.TrainConfig`; ``resume_from``: the
    :class:`ResumePoint` to start the engine's run from; ``progress_fd``: where global rank 0
    prints its progress (default: stdout). ``name_lost_peers`` (under torchrun, where no
    parent watches the ranks as :func:`engine.launch` does): a collective that fails because
    peers are gone names them (:class:`engine.elastic.PeerLostError`). ``step_file``: where
    global rank 0 keeps the number of the last step done, for the launcher's ending on
    Ctrl-C (:mod:`engine.train_endings`)."""
    if not name_lost_peers:
        return run_implementations(cfg, resume_from, progress_fd, step_file)
    peers = Peers()
    tell_how_nccl_loses_peers(cfg.timeout)  # on NCCL a lost peer is a watchdog timeout
    try:
        return run_implementations(cfg, resume_from, progress_fd, step_file)
    except Exception as e:
        lost = peers.lost(e)
        if lost is None:
            raise
        raise lost from e


def run_implementations(cfg, resume_from: ResumePoint | None, progress_fd: int | None,
                        step_file: str | None = None) -> dict:
    """Each of ``cfg.implementations`` in turn on this rank's device, on the same global
    batch: its strategy, formulas and measurements (:func:`train_on_rank`)."""
    device = rank_device()
    precision = resolve_precision(cfg.precision, device)
    # one mesh of every axis; each step draws the global batch of its index itself
    mesh = Mesh(cfg.dp, cfg.tp, cfg.pp, cp=cfg.cp, ep=cfg.ep)
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
           "precision": precision}
    for impl in cfg.implementations:
        strategy = build(cfg, None, impl, mesh, device, precision)
        formulas = composed_traffic_formulas(strategy, cfg) if impl == "engine" else {}
        run, first_step, losses, blocked_s = train(
            strategy, cfg, resume_from if impl == "engine" else None, progress_fd, step_file)
        moe = strategy.moe_stats() if hasattr(strategy, "moe_stats") else None
        if impl == "engine" and cfg.ep > 1 and moe and moe["crossing_rows"]:
            # the experts' all-to-alls: their formula from the rows the router sent out in the
            # counted step (this launch's first)
            formulas = composed_traffic_formulas(strategy, cfg, moe["crossing_rows"][0])
        offset = clock_offset(device)  # each rank's events on rank 0's clock (several nodes)
        out[impl] = {"first_step": first_step, "run_losses": losses,
            "name": strategy.name, "coords": mesh.coords, "device_type": device.type,
            "step_s": run.step_s, "compute_s": run.compute_s, "losses": run.losses,
            "traffic": run.traffic, "counted": run.counted, "formulas": formulas,
            "save_blocked_s": blocked_s,
            "psi": strategy.psi, "memory_formula": memory_formula(strategy, cfg),
            "state": strategy.state_bytes(),
            "activations": run.last.peak_activation_bytes,
            "events": on_clock(run.last.events, offset),
            "cuda_allocated": run.cuda_allocated, "cuda_peak": run.cuda_peak,
            "moe": moe,
            "composed": True}
    return out


def start(strategy, cfg, point: ResumePoint | None) -> tuple[int, list[float]]:
    """Load ``point`` into ``strategy`` (re-cut if it must be); the steps done and their
    losses. Every rank checks it got the same point as the others."""
    chosen = [None] * dist.get_world_size()
    dist.all_gather_object(chosen, None if point is None else (point.path, point.step))
    if len(set(chosen)) > 1:
        raise RuntimeError(f"the ranks found different checkpoints to resume from: {chosen} "
                           "(a save still in progress when they started?)")
    if point is None:
        return 0, []
    if point.reshard:
        reshard_composed(point.path, strategy)
    else:
        checkpoints.load(point.path, strategy)
    return point.step, list(point.losses)


def train(strategy, cfg, point: ResumePoint | None = None, progress_fd: int | None = None,
          step_file: str | None = None) -> tuple[StepsRun, int, list[float], list[float]]:
    """Run ``strategy`` to the last step; return the timed run, the step it started from,
    the loss of every step of the run (those before it from the checkpoint) and, per save,
    the seconds the step was blocked by it (``--async-save``: the host snapshot only)."""
    if cfg.save is not None and not strategy.checkpointable:
        raise ValueError(f"--save: {strategy.name} has no sharded checkpoint here")
    loading = time.perf_counter()
    first, losses = start(strategy, cfg, point)
    loaded_s = time.perf_counter() - loading
    total = total_steps(cfg)
    remaining = total - first
    warmup = 1 if remaining > 1 else 0
    bar = Progress(total, progress_fd, step_file) if dist.get_rank() == 0 else None
    if bar and first:
        bar.note(f"resumed from {point.path} after step {first}"
                 + (" (re-cut for this layout)" if point.reshard else "")
                 + f", loaded in {loaded_s:.2f} s")

    saver = checkpoints.AsyncSaver() if getattr(cfg, "async_save", False) else None

    def after_step(step: int, run) -> None:
        done = step + 1
        losses.append(run.loss)  # the global loss, the same on every rank
        save = cfg.save is not None and (done == total or (cfg.save_every is not None and
                                                           done % cfg.save_every == 0))
        if save:
            began = time.perf_counter()
            (saver or checkpoints).save(cfg.save, done, strategy, trainer_record(cfg, losses),
                                        cfg.keep)
            blocked_s.append(time.perf_counter() - began)
        if bar:
            bar.update(done, losses[-1], saved=save, warmup=warmup == 1 and step == first,
                       blocked_s=blocked_s[-1] if save else None, background=saver is not None)
        kill_point(done, cfg.kill_at_step, dist.get_world_size() - 1 if cfg.kill_rank is None
                   else cfg.kill_rank)

    blocked_s: list[float] = []  # per save: the seconds the step waited for it
    # each step draws step k's global batch itself: the "inputs" are the step indices
    run = run_steps(strategy, itertools.count(first), None, remaining - warmup, warmup,
                    first_step=first, after_step=after_step)
    if saver is not None:
        saver.wait()  # the last checkpoint is complete before the run reports
    if bar:
        bar.close()
    return run, first, losses, blocked_s


def trainer_record(cfg, losses: list[float]) -> dict:
    """What ``trainer.json`` keeps besides the step: the configuration that shapes the
    training and the loss of every step so far."""
    return {"config": {**{name: getattr(cfg, name, None) for name in SAME_TRAINING +
                          SAME_LAYOUT}, **composed_record(cfg)},
            "losses": list(losses)}


class Progress:
    """One line per step (``step 3/6 [#####-----] loss 4.0122  45 ms``), rewritten in place on
    a terminal. ``fd``: where to write (a forked rank's stdout is captured; the launching
    terminal's is passed down), else this process's stdout. ``step_file``: rewritten after
    each step with the number of steps done (how far a run got when it is interrupted)."""

    WIDTH = 20

    def __init__(self, total: int, fd: int | None, step_file: str | None = None):
        self.total, self.last, self.step_file = total, time.perf_counter(), step_file
        self.width = 0  # of the last line written
        self.out = os.fdopen(fd, "w", closefd=False) if fd is not None else sys.stdout
        self.tty = self.out.isatty()

    def note(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def update(self, done: int, loss: float, saved: bool, warmup: bool = False,
               blocked_s: float | None = None, background: bool = False) -> None:
        if self.step_file is not None:
            with open(self.step_file, "w") as f:
                f.write(str(done))
        now = time.perf_counter()
        filled = round(self.WIDTH * done / self.total)
        line = (f"step {done}/{self.total} [{'#' * filled}{'-' * (self.WIDTH - filled)}] "
                f"loss {loss:.4f}  {(now - self.last) * 1e3:.0f} ms"
                + ("  (warm-up, not timed)" if warmup else "")
                + ("" if not saved else "  (checkpoint saved)" if not background else
                   f"  (checkpoint snapshot taken, step blocked {blocked_s * 1e3:.0f} ms; "
                   "written in the background)"))
        self.last, shorter = now, max(0, self.width - len(line))
        self.width = len(line)  # on a terminal, blank what a longer line left behind
        print(("\r" + line + " " * shorter) if self.tty else line, end="" if self.tty else "\n",
              file=self.out, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=self.out, flush=True)
