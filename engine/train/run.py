"""One ``engine train`` run on one rank: :func:`train_on_rank` builds each implementation's
strategy (:func:`build`), works out the formulas the report prints
(:mod:`engine.train.formulas`) and runs it from step 0 or from a checkpoint, through the timed
steps (:func:`engine.train.timed_steps.run_steps`), with what a real run does after each step:

* the loss of the step, the mean over every counted token of its global batch (the step
  returns it on every rank), and a progress bar printed by global rank 0; a loss that is not
  finite stops every rank at that step, before it is saved, naming the first rank and layer
  where a non-finite value appeared (:mod:`engine.train.nonfinite`);
* a checkpoint every ``--save-every`` steps and after the last (:mod:`engine.checkpoint.trainer`);
* for labs and tests only, the kill of one rank at a chosen step (:func:`engine.launch.elastic.
  kill_point`).

A run has ``--steps`` optimizer steps, numbered 1 to ``--steps`` and named so in its
checkpoints (``step-00000004`` after step 4). The first step of each launch is its warm-up:
it trains like every other, but is not timed (it counts the bytes instead). A run resumed
after ``k`` steps runs the other ``steps - k`` (the first of them the warm-up), each on its
step's global batch, so it computes exactly what the uninterrupted run computes from step
``k`` on: the loss curve and the final parameters are bit-identical on the CPU.

Which checkpoint to resume from, and whether it fits this run, is decided before any rank
starts, and loaded by every rank (:mod:`engine.train.resume`). A run that stops itself (a
non-finite loss, a checkpoint that would not load)
returns ``{"stopped": line, "exit": code}`` from every rank instead of raising, so that the
command prints one line, not a rank's traceback (:func:`engine.train.endings.stopped`).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from engine.checkpoint import trainer as checkpoints
from engine.launch.device import rank_device
from engine.launch.elastic import Peers, kill_point, tell_how_nccl_loses_peers
from engine.train.strategy import Strategy, resolve_precision
from engine.train.timed_steps import StepsRun, run_steps
from engine.observe.trace import clock_offset, on_clock
from engine.train.endings import NONFINITE_EXIT, REFUSED_EXIT
from engine.compose.plan import Plan
from engine.topology import Mesh
from engine.train.composed import composed_strategy, plan_of
from engine.train.torch_baseline import torch_strategy
from engine.train.formulas import composed_traffic_formulas, memory_formula
from engine.train.nonfinite import NonFiniteLoss, NonFiniteWatch
from engine.train.resume import ResumeFailed, ResumePoint, start, total_steps, trainer_record


# -- on every rank ------------------------------------------------------------------------------


def train_on_rank(rank: int, world_size: int, cfg, resume_from: ResumePoint | None = None,
                  progress_fd: int | None = None, name_lost_peers: bool = False,
                  step_file: str | None = None) -> dict:
    """Build each implementation's strategy, run the steps, return what the report needs.
    ``cfg``: an :class:`engine.train.cli.TrainConfig`; ``resume_from``: the
    :class:`ResumePoint` to start the engine's run from; ``progress_fd``: where global rank 0
    prints its progress (default: stdout). ``name_lost_peers`` (under torchrun, where no
    parent watches the ranks as :func:`engine.launch` does): a collective that fails because
    peers are gone names them (:class:`engine.launch.elastic.PeerLostError`). ``step_file``: where
    global rank 0 keeps the number of the last step done, for the launcher's ending on
    Ctrl-C (:mod:`engine.train.endings`)."""
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


def build(cfg, impl: str, plan: Plan, device: torch.device, precision: str,
          mesh: Mesh) -> Strategy:
    """The strategy of ``impl`` ("engine" or "torch") for ``cfg`` (a
    :class:`engine.train.cli.TrainConfig`) and its ``plan``
    (:func:`engine.train.composed.plan_of`) on ``mesh`` (``plan.mesh()``, built once for every
    implementation): the composed engine, or PyTorch's wrappers on the same GPT
    (:func:`engine.train.composed.model_config` of ``cfg``)."""
    if impl == "torch":
        return torch_strategy(cfg, mesh, device, precision)
    if impl != "engine":
        raise ValueError(f"--impl must be engine or torch here, got {impl!r}")
    return composed_strategy(cfg, plan, mesh, device, precision)


def run_implementations(cfg, resume_from: ResumePoint | None, progress_fd: int | None,
                        step_file: str | None = None) -> dict:
    """Each of ``cfg.implementations`` in turn on this rank's device, on the same global
    batch: its strategy, formulas and measurements (:func:`train_on_rank`)."""
    device = rank_device()
    precision = resolve_precision(cfg.precision, device)
    # one plan, its mesh of every axis; each step draws the global batch of its index itself
    plan = plan_of(cfg)
    mesh = plan.mesh()
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
           "precision": precision}
    for impl in cfg.implementations:
        strategy = build(cfg, impl, plan, device, precision, mesh)
        formulas = composed_traffic_formulas(strategy, cfg) if impl == "engine" else {}
        resumed: dict = {}
        try:
            run, first_step, losses, blocked_s = train(
                strategy, cfg, resume_from if impl == "engine" else None, progress_fd,
                step_file, resumed)
        except NonFiniteLoss as e:  # every rank, at the same step: one line, exit code 1
            return {**out, "stopped": f"--impl {impl}: {e}" if len(cfg.implementations) > 1
                    else str(e), "exit": NONFINITE_EXIT}
        except ResumeFailed as e:
            return {**out, "stopped": str(e), "exit": REFUSED_EXIT}
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
            "moe": moe, "resumed_from": resumed.get("path"),
            "resume_skipped": resumed.get("skipped", []),
            "composed": True}
    return out


def train(strategy, cfg, point: ResumePoint | None = None, progress_fd: int | None = None,
          step_file: str | None = None, resumed: dict | None = None
          ) -> tuple[StepsRun, int, list[float], list[float]]:
    """Run ``strategy`` to the last step; return the timed run, the step it started from,
    the loss of every step of the run (those before it from the checkpoint) and, per save,
    the seconds the step was blocked by it (``--async-save``: the host snapshot only).
    ``resumed`` (a dict, filled in): the checkpoint it started from (``path``, None: step 0)
    and the newer ones ``--resume-fallback`` passed over (``skipped``). A loss that is not
    finite raises :class:`engine.train.nonfinite.NonFiniteLoss` on every rank, before that
    step is saved."""
    resumed = {} if resumed is None else resumed
    loading = time.perf_counter()
    point, skipped = start(strategy, cfg, point)
    first, losses = (0, []) if point is None else (point.step, list(point.losses))
    loaded_s = time.perf_counter() - loading
    total = total_steps(cfg)
    remaining = total - first
    warmup = 1 if remaining > 1 else 0
    bar = Progress(total, progress_fd, step_file) if dist.get_rank() == 0 else None
    if bar and first:
        bar.note(f"resumed from {point.path} after step {first}"
                 + (" (re-cut for this layout)" if point.reshard else "")
                 + f", loaded in {loaded_s:.2f} s")
    if bar and skipped:
        bar.note("--resume-fallback passed over " + "; ".join(skipped))
    resumed.update(path=None if point is None else point.path, skipped=skipped)

    saver = checkpoints.AsyncSaver() if getattr(cfg, "async_save", False) else None

    watch = NonFiniteWatch(strategy.model)

    def after_step(step: int, run) -> None:
        done = step + 1
        # the global loss, the same on every rank: every rank stops here alike
        # on a non-finite loss only, every rank runs this step again with its hooks armed
        watch.check(done, run.loss, total, advice=f"the run stopped before saving step "
                    f"{done}; lower --lr (now {cfg.lr:g}) or look at that layer",
                    replay=lambda: strategy.step(step))
        losses.append(run.loss)
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
    try:  # each step k draws step k's global batch itself
        run = run_steps(strategy, remaining - warmup, warmup, first_step=first,
                        after_step=after_step)
    except NonFiniteLoss:
        if bar:
            bar.close()
        if saver is not None:
            saver.wait()  # a healthy step's checkpoint in flight is completed
        raise
    finally:
        watch.remove()
    if saver is not None:
        saver.wait()  # the last checkpoint is complete before the run reports
    if bar:
        bar.close()
    return run, first, losses, blocked_s


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
