"""Which checkpoint ``engine train --resume`` starts from, checked before any rank starts
(:func:`resume_point`), and its load on every rank (:func:`start`).

A checkpoint of another run (another ``--model``, ``--seed``, ``--lr``, ``--precision``) is
refused; one of another layout loads only with ``--reshard``, which re-cuts it through the
whole model (:mod:`engine.compose.reshard`). A checkpoint written by the per-layout trainers
this engine replaced is refused by name. Its ``trainer.json`` (written by
:func:`trainer_record`) is checked field by field and its manifest against it
(:func:`checked_trainer`): a step that is not its folder's, a missing field, a wrong type,
another kind of checkpoint is one line naming the file and the field, before any rank
starts. Its rank files are read, checked against their SHA-256, by the ranks themselves
(:func:`start`, through :mod:`engine.checkpoint.protocol`, so every rank learns of a failure
at once): a missing or corrupted one stops every rank with one line naming the rank and the
file (:class:`ResumeFailed`).

With ``--resume-fallback`` a damaged newest checkpoint is passed over for the newest complete
one before it that loads, and the run says which it used and why (:class:`ResumePoint`
``older`` and ``skipped``); global rank 0 then moves each one passed over aside, to
``DIR/damaged-step-NNNNNNNN`` (:func:`move_aside`), so that no later resume or pruning takes
it for a checkpoint of this run (the newest ``--keep`` are the newest sound ones) and the
evidence stays. A checkpoint that does not fit this run is refused whatever the flag: it is
another run's, not a damaged one.
"""

from __future__ import annotations

import math
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch.distributed as dist

from engine.checkpoint import trainer as checkpoints
from engine.checkpoint.files import CheckpointError
from engine.checkpoint.per_rank import read_per_rank_manifest
from engine.train.composed import check_composed_reshard, reshard_composed

# what a checkpoint must agree with the run on: always, and (without --reshard) the layout
SAME_TRAINING = ("model", "seed", "lr", "precision", "data", "vocab")
SAME_LAYOUT = ("dp", "ep", "tp", "pp", "zero", "schedule", "microbatches", "micro_batch")
# the composed engine's (engine.train.composed) besides: a checkpoint written before they
# existed has their defaults
COMPOSED_LAYOUT = {"cp": 1, "cp_method": "ring-zigzag", "sequence_parallel": False,
                   "varlen": False, "engine": "per-layout"}
RESHARDED_COMPOSED = ("cp", "cp_method", "sequence_parallel")  # --reshard re-cuts them too
# (engine.compose.reshard)


@dataclass(frozen=True)
class ResumePoint:
    """A checkpoint to start from: its directory, the steps it holds, the loss of each, and
    whether it must be re-cut for this layout. ``previous``: the name of the complete
    checkpoint before it, if any (what ``--resume-fallback`` would try). With
    ``--resume-fallback``: ``older``, the next checkpoint to try if this one does not load,
    and ``skipped``, each newer one passed over: its directory and why."""

    path: str
    step: int
    losses: list[float]
    reshard: bool = False
    previous: str | None = None
    older: ResumePoint | None = None
    skipped: tuple[tuple[str, str], ...] = ()


class ResumeFailed(RuntimeError):
    """The checkpoint ``--resume`` chose did not load on some rank (a rank file missing or
    failing its SHA-256, a state that does not apply), and no fallback was asked for or
    left: the one line that says so, raised on every rank."""


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# trainer.json's configuration, field by field: (check, what was expected); the composed
# engine's fields may be absent (a checkpoint older than them has their defaults), and so may
# any in a checkpoint of the per-layout trainers (refused by name once read: resume_point)
TRAINER_FIELDS = {
    "model": (lambda v: isinstance(v, str), "a model's name"),
    "seed": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
             "an int >= 0"),
    "lr": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
           and math.isfinite(v) and v > 0, "a positive number"),
    "precision": (lambda v: isinstance(v, str), "a precision's name"),
    **{name: (_positive, "a positive int") for name in ("dp", "ep", "tp", "pp",
                                                        "microbatches", "micro_batch")},
    "zero": (lambda v: v in (0, 1, 2, 3) and not isinstance(v, bool), "0, 1, 2 or 3"),
    "schedule": (lambda v: isinstance(v, str), "a schedule's name"),
}
COMPOSED_FIELDS = {
    "cp": (_positive, "a positive int"),
    "cp_method": (lambda v: isinstance(v, str), "a context-parallel method's name"),
    "sequence_parallel": (lambda v: isinstance(v, bool), "true or false"),
    "varlen": (lambda v: isinstance(v, bool), "true or false"),
    "engine": (lambda v: v in ("composed", "per-layout"), "'composed' or 'per-layout'"),
}


def total_steps(cfg) -> int:
    """The optimizer steps of the whole run: ``--steps``, the warm-up among them."""
    return cfg.steps


def resume_point(cfg) -> ResumePoint | None:
    """The checkpoint this run starts from (None: step 0); a ValueError saying why the
    newest one in ``--save`` does not fit, or a CheckpointError naming what is damaged in it
    (with ``--resume-fallback``: in every one). Reads files only: call before any rank
    starts."""
    if cfg.save is None:
        return None
    found = checkpoints.complete(cfg.save)
    if not cfg.resume:
        if found:
            raise ValueError(f"--save {cfg.save} already holds checkpoints (the newest: "
                             f"{found[-1].name}); pass --resume to continue that run, or "
                             "--save an empty directory")
        return None
    if not found:
        return None  # nothing saved yet: --resume on a first start (torchrun restarts alike)
    if not getattr(cfg, "resume_fallback", False):
        try:
            return replace(_point(cfg, found[-1]),
                           previous=found[-2].name if len(found) > 1 else None)
        except CheckpointError as e:
            raise CheckpointError(f"--resume: {e}" + ("" if len(found) == 1 else
                                  "; pass --resume-fallback to resume from the complete "
                                  f"checkpoint before it, {found[-2].name}")) from None
    # --resume-fallback: every complete checkpoint, newest first, that is sound and fits;
    # ranks that cannot load one fall back to the next (start)
    usable, skipped = [], []
    for path in reversed(found):
        try:
            point = _point(cfg, path)
        except CheckpointError as e:
            skipped.append((str(path), str(e)))
            continue
        except ValueError:
            if usable:  # an older run's checkpoint that does not fit: the chain ends here
                break
            raise
        usable.append(replace(point, skipped=tuple(skipped)))
        skipped = []
    if not usable:
        raise CheckpointError(f"--resume --resume-fallback: no checkpoint in {cfg.save} is "
                              "sound: " + "; ".join(reason for _, reason in skipped))
    older = None
    for point in reversed(usable):
        older = replace(point, older=older)
    return older


def checked_trainer(path) -> dict:
    """Checkpoint ``path``'s ``trainer.json``, checked field by field, and its manifest
    against it: a :class:`CheckpointError`, one line naming the file and the field, for a
    step that is not its folder's, a missing field, a wrong type, or another kind of
    checkpoint (module docstring)."""
    path = Path(path)
    file = path / checkpoints.TRAINER
    saved = checkpoints.read_trainer(path)

    def bad(field: str, expected: str, got=None, missing: bool = False) -> CheckpointError:
        if isinstance(got, (list, dict)):  # its shape, not its whole content
            got = f"a {'list' if isinstance(got, list) else 'JSON object'} of {len(got)}"
        else:
            got = repr(got)
        return CheckpointError(f"{file} is malformed: {field} " + (
            f"is missing, expected {expected}" if missing else f"must be {expected}, got {got}"))

    if not isinstance(saved, dict):
        raise bad("its content", "a JSON object with step, config and losses", saved)
    number = int(path.name.split("-")[1])
    if "step" not in saved:
        raise bad("'step'", f"{number} (its folder is {path.name})", missing=True)
    step = saved["step"]
    if not (_positive(step) and step == number):
        raise bad("'step'", f"{number} (its folder is {path.name})", step)
    if "config" not in saved:
        raise bad("'config'", "the run's configuration", missing=True)
    config = saved["config"]
    if not isinstance(config, dict):
        raise bad("'config'", "a JSON object (the run's configuration)", config)
    composed = config.get("engine") == "composed"
    for name, (check, expected) in {**TRAINER_FIELDS, **COMPOSED_FIELDS}.items():
        if name not in config:
            if name in TRAINER_FIELDS and composed:
                raise bad(f"'config.{name}'", expected, missing=True)
            continue
        if not check(config[name]):
            raise bad(f"'config.{name}'", expected, config[name])
    if "losses" not in saved:
        raise bad("'losses'", f"the loss of each of its {step} steps", missing=True)
    losses = saved["losses"]
    if not isinstance(losses, list) or len(losses) != step:
        raise bad("'losses'", f"a list of {step} losses, one per step", losses)
    for i, loss in enumerate(losses):
        if not isinstance(loss, (int, float)) or isinstance(loss, bool) or \
                not math.isfinite(loss):
            raise bad(f"'losses[{i}]'", "a finite number (the loss of step "
                      f"{i + 1})", loss)
    manifest = read_per_rank_manifest(path)  # another kind's, or damaged: named there
    ranks = math.prod(config.get(name, 1) for name in ("dp", "cp", "tp", "pp"))
    if manifest["world_size"] != ranks:
        raise CheckpointError(f"{path / 'manifest.json'} does not match {file}: "
                              f"'world_size' is {manifest['world_size']}, expected dp x cp x "
                              f"tp x pp = {ranks}")
    return saved


def _point(cfg, path) -> ResumePoint:
    """Checkpoint ``path`` as this run's :class:`ResumePoint`: a :class:`CheckpointError` if
    it is damaged (:func:`checked_trainer`), a ValueError if it does not fit this run."""
    saved = checked_trainer(path)
    config = saved["config"]
    for name in SAME_TRAINING:
        if config.get(name) != getattr(cfg, name):
            raise ValueError(f"--resume: {path} was saved by a run with --{_flag(name)} "
                             f"{config.get(name)}, this run has --{_flag(name)} "
                             f"{getattr(cfg, name)}; a resumed run keeps --model, --seed, "
                             "--lr, --precision, --data and --vocab (or --save a new "
                             "directory)")
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


def trainer_record(cfg, losses: list[float]) -> dict:
    """What ``trainer.json`` keeps besides the step: the configuration that shapes the
    training and the loss of every step so far."""
    return {"config": {**{name: getattr(cfg, name, None) for name in SAME_TRAINING +
                          SAME_LAYOUT}, **composed_record(cfg)},
            "losses": list(losses)}


# -- on every rank ------------------------------------------------------------------------------


def start(strategy, cfg, point: ResumePoint | None) -> tuple[ResumePoint | None, list[str]]:
    """Load ``point`` into ``strategy`` (re-cut if it must be); the point loaded and, one
    line each, the newer ones passed over. Every rank checks it got the same point as the
    others. A checkpoint that does not load (every rank learns of it together:
    :mod:`engine.checkpoint.protocol`) is :class:`ResumeFailed`, or with
    ``--resume-fallback`` passed over for ``point.older``; once one loads, global rank 0
    moves those passed over aside (:func:`move_aside`)."""
    chosen = [None] * dist.get_world_size()
    dist.all_gather_object(chosen, None if point is None else (point.path, point.step))
    if len(set(chosen)) > 1:
        raise RuntimeError(f"the ranks found different checkpoints to resume from: {chosen} "
                           "(a save still in progress when they started?)")
    skipped = list(point.skipped) if point is not None else []
    while point is not None:
        try:
            if point.reshard:
                reshard_composed(point.path, strategy)
            else:
                checkpoints.load(point.path, strategy)
            return point, [f"{Path(path).name} (moved to {move_aside(path)}): {reason}"
                           for path, reason in skipped]
        except CheckpointError as e:
            # "rank 0 cannot load: rank 1 could not load DIR: ...": the failed rank's own words
            said = re.sub(r"rank (\d+) cannot load: (?=rank \1 )", "", str(e))
            if point.older is None or not getattr(cfg, "resume_fallback", False):
                after = "" if point.previous is None else \
                    (f"; pass --resume-fallback to resume from the complete checkpoint "
                     f"before it, {point.previous}")
                raise ResumeFailed(f"--resume: {point.path} cannot be loaded: {said}"
                                   f"{after}") from None
            skipped.append((point.path, said))
            skipped.extend(point.older.skipped)
            point = point.older
    return None, []


def move_aside(path) -> str:
    """On global rank 0, rename the damaged checkpoint ``path`` (``DIR/step-NNNNNNNN``) to
    ``DIR/damaged-step-NNNNNNNN`` (replacing an older one of that name), out of the way of
    :func:`engine.checkpoint.trainer.latest` and of pruning; returns the new name (on a rank
    that cannot rename it, why not: only rank 0 renames, and it must not fail alone)."""
    path = Path(path)
    aside = path.with_name(f"damaged-{path.name}")
    if dist.get_rank() == 0:
        try:
            shutil.rmtree(aside, ignore_errors=True)
            path.rename(aside)
        except OSError as e:
            return f"not moved aside: {e.strerror or e}"
    return aside.name
