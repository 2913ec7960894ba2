"""``python -m engine train``: train the GPT on a dp x cp x tp x pp mesh (experts over ep ranks
borrowed from dp x cp) and report what a lab measures, each number beside the formula it
checks (:mod:`engine.train.report`).

    python -m engine train --world-size 4 --dp 2 --tp 2 --steps 4          # CPU ranks, Gloo
    torchrun --nproc-per-node 8 -m engine train --dp 2 --tp 4 --pp 1        # one GPU node
    python -m engine train --world-size 2 --dp 2 --impl both               # vs torch DDP
    python -m engine train --world-size 2 --dp 2 --zero 0 --compress fp16 --impl both
    python -m engine train --ep 2 --dp 2 --model tiny-moe                  # experts on 2 ranks
    python -m engine train --world-size 4 --cp 2 --tp 2                    # ring attention + TP
    python -m engine data prepare course/data/alice.txt --out /tmp/alice.bin  # a real text
    python -m engine train --model llama-tiny --vocab 256 --data /tmp/alice.bin --steps 30
    python -m engine train --dry-run --model llama3-8b --dp 8 --tp 8 --pp 4 --attention fast

This module is the configuration (:class:`TrainConfig`, :func:`check_config`) and the command
line; each rank's run is :func:`engine.train.run.train_on_rank`, the report
:mod:`engine.train.report`, the model sizes :mod:`engine.model.presets`, and how a run that stops
early says so in one line (Ctrl-C, a lost peer, nothing to do) :mod:`engine.train.endings`.
``--steps K`` is the run's K optimizer steps, numbered 1 to K as its checkpoints are; the
first of each launch is its warm-up, which trains but is not timed. Every run trains on the
synthetic Markov chain of :mod:`engine.model.data`, or with ``--data PATH`` on a file of token
ids (:mod:`engine.model.tokens`, written by ``python -m engine data prepare``:
:mod:`engine.model.prepare`); ``--vocab N`` sets the model's vocabulary (a byte-level file
needs 256, more than the small presets' 64).

There is one engine: every ``--impl engine`` run, dense or MoE, any ``--dp --cp --ep --tp --pp
--zero --compress --schedule --varlen``, is the composed engine (:mod:`engine.train.composed`:
one :class:`engine.topology.Mesh`, one GPT parallelised by functions, one loop), as torchtitan
and Megatron-Core are one system each. ``--impl torch`` runs PyTorch's own DDP /
ZeroRedundancyOptimizer / FSDP for the same data-parallel configuration on the same GPT and
the same global batch (:func:`engine.train.torch_baseline.torch_strategy`); ``--impl both``
runs the two one after the other in the same launch, and prints the same loss per step for
both. Each runs through the one loop of :mod:`engine.train.timed_steps`. Only global rank 0
prints the report and writes the trace, under torchrun too.

PyTorch has no DDP hook for Top-K or Random-K, and its ``powerSGD_hook`` desynchronised the
ranks inside this trainer, so those compare with ``--impl engine`` only (chapter 03 checks our
PowerSGD against that hook step by step).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass, fields, replace

import torch

from engine.checkpoint.files import CheckpointError
from engine.launch import resolve_backend
from engine.moe.gpt import MOE_MODELS
from engine.model.presets import MODELS
from engine.train.checks import MAX_TIMEOUT_S, MIN_TIMEOUT_S, check_batch, \
    check_checkpointing, check_data, check_paths, check_torch, check_world
from engine.train.composed import COMPOSED_SCHEDULES, add_composed_arguments, check_composed, \
    composed_world
from engine.train.endings import INTERRUPTED_EXIT, interrupted, lost_peer, read_step, \
    stopped, tell_torchrun
from engine.train.report import report, resolved
from engine.train.resume import resume_point, total_steps
from engine.train.run import train_on_rank
from engine.validation import ArgumentParser, one_of, positive_int, positive_number

IMPLS = {"engine": ("engine",), "torch": ("torch",), "both": ("engine", "torch")}


@dataclass(frozen=True)
class TrainConfig:
    dp: int = 1
    cp: int = 1
    ep: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 1
    schedule: str = "1f1b"
    microbatches: int = 2
    micro_batch: int = 4
    model: str = "tiny"
    steps: int = 4
    lr: float = 1e-2
    impl: str = "engine"
    precision: str = "auto"
    compress: str | None = None
    trace: str | None = None
    peak_tflops: float | None = None
    seed: int = 0
    save: str | None = None
    save_every: int | None = None
    keep: int = 2
    async_save: bool = False
    resume: bool = False
    resume_fallback: bool = False
    reshard: bool = False
    timeout: float = 300.0
    kill_at_step: int | None = None
    kill_rank: int | None = None
    cp_method: str = "ring-zigzag"
    sequence_parallel: bool = False
    varlen: bool = False
    allow_oversubscribe: bool = False
    data: str | None = None
    vocab: int | None = None
    attention: str = "written"
    dry_run: bool = False
    compile: bool = False

    @property
    def world_size(self) -> int:
        """dp x cp x tp x pp: ``--ep`` borrows its ranks from dp x cp."""
        return composed_world(self)

    @property
    def implementations(self) -> tuple[str, ...]:
        """The implementations ``--impl`` runs, in order: the engine's, PyTorch's, or both."""
        return IMPLS[self.impl]


def check_config(cfg: TrainConfig, world_size: int | None = None) -> None:
    """Every clear error we can give before a rank starts."""
    for name in ("dp", "cp", "ep", "tp", "pp", "microbatches", "micro_batch", "steps"):
        positive_int(f"--{name.replace('_', '-')}", getattr(cfg, name))
    positive_number("--lr", cfg.lr)
    if cfg.peak_tflops is not None:
        positive_number("--peak-tflops", cfg.peak_tflops)
    for name, choices in (("model", MODELS), ("zero", (0, 1, 2, 3)),
                          ("schedule", COMPOSED_SCHEDULES), ("impl", IMPLS),
                          ("precision", ("auto", "fp32", "bf16"))):
        one_of(f"--{name}", getattr(cfg, name), choices)
    check_batch(cfg)
    if cfg.ep > 1 and cfg.model not in MOE_MODELS:
        raise ValueError(f"--ep {cfg.ep} spreads experts, and --model {cfg.model} has none; "
                         f"use --model {' or '.join(MOE_MODELS)}")
    if cfg.impl != "engine":
        check_torch(cfg)
    check_checkpointing(cfg)
    check_data(cfg)
    check_composed(cfg, world_size)


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m engine train", description=__doc__.split("\n\n")[0],
                       allow_abbrev=False)
    d = TrainConfig()
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks to launch here (default: dp x cp x tp x pp; under torchrun "
                        "its WORLD_SIZE)")
    for name, what in (("dp", "data-parallel"),
                       ("cp", "context-parallel (the composed engine: ring attention or "
                        "Ulysses over cp ranks, each its tokens of every sequence)"),
                       ("ep", "expert-parallel (--model tiny-moe: experts spread over ep "
                        "ranks borrowed from dp x cp, as in torchtitan and Megatron-Core; ep "
                        "must divide dp x cp)"),
                       ("tp", "tensor-parallel"), ("pp", "pipeline-parallel")):
        p.add_argument(f"--{name}", type=int, default=getattr(d, name),
                       help=f"{what} degree (default: %(default)s)")
    p.add_argument("--zero", type=int, default=d.zero, choices=(0, 1, 2, 3),
                   help="ZeRO stage over dp x cp: 0 none, 1 optimizer state, 2 + gradients, "
                        "3 + parameters; --model tiny-moe takes 0 unless given "
                        "(default: %(default)s)")
    p.add_argument("--schedule", default=d.schedule, choices=COMPOSED_SCHEDULES,
                   help="pipeline schedule, used when --pp > 1: every schedule of "
                        "engine.pp's registry (default: %(default)s)")
    add_composed_arguments(p, d)
    p.add_argument("--microbatches", type=int, default=d.microbatches,
                   help="micro-batches per step, m; the global batch, dp x m x b sequences, "
                        "holds at most 2**24 tokens (default: %(default)s)")
    p.add_argument("--micro-batch", type=int, default=d.micro_batch,
                   help="sequences per micro-batch, b; at most 2**20 tokens "
                        "(default: %(default)s)")
    p.add_argument("--model", default=d.model, choices=tuple(MODELS),
                   help="GPT size: " + "; ".join(f"{k} {m.layers} layers, hidden {m.hidden}, "
                                                 f"sequence {m.seq_len}"
                                                 for k, m in MODELS.items())
                   + " (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=d.vocab, metavar="N",
                   help="the model's vocabulary, instead of --model's (at least 2, and at "
                        "least --data's) (default: --model's)")
    p.add_argument("--data", default=d.data, metavar="PATH",
                   help="train on a file of token ids (nanoGPT's .bin with its sidecar "
                        "PATH.json: python -m engine data prepare TEXT_FILE --out PATH), "
                        "step k on windows drawn from (--seed, k) alone: the same sequences "
                        "on every layout (engine.model.tokens) (default: the synthetic "
                        "Markov chain of engine.model.data)")
    p.add_argument("--attention", default=d.attention, choices=("written", "fast"),
                   help="the attention kernel: written (the equation a learner reads, "
                        "engine.model.attention) or fast (PyTorch's fused "
                        "scaled_dot_product_attention: FlashAttention on GPUs) "
                        "(default: %(default)s)")
    p.add_argument("--dry-run", action="store_true",
                   help="no training: one step of this layout on one rank per pipeline "
                        "stage, on a fake process group with the model on the meta device; "
                        "what each holds, sends and computes (engine.train.dry_run) "
                        "(default: False)")
    p.add_argument("--compile", action="store_true", help="torch.compile each block's "
                   "forward (dp, ZeRO, pp; not tp, cp, ep yet) (default: False)")
    p.add_argument("--steps", type=int, default=d.steps, metavar="K",
                   help="optimizer steps in all, numbered 1 to K as the checkpoints are; "
                        "the first of each launch is its warm-up: it trains, but is not "
                        "timed (default: %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr,
                   help="AdamW learning rate (default: %(default)s)")
    p.add_argument("--impl", default=d.impl, choices=tuple(IMPLS),
                   help="engine: this engine; torch: PyTorch's DDP / ZeroRedundancyOptimizer "
                        "/ FSDP on the same GPT and data (--dp only); both: one after the "
                        "other (default: %(default)s)")
    p.add_argument("--precision", default=d.precision, choices=("auto", "fp32", "bf16"),
                   help="auto: bf16 autocast on a GPU, fp32 on the CPU; with --zero 3 bf16 "
                        "also gathers the parameters in bf16 and reduces the gradients in "
                        "fp32 (engine.fsdp's MixedPrecisionPolicy); MFU uses this precision's "
                        "peak (default: %(default)s)")
    p.add_argument("--compress", default=d.compress, metavar="SPEC",
                   help="gradient compression of the dense gradients' all-reduce over dp x "
                        "cp (--zero 0: DDP's, or a pipeline stage's at the step, also beside "
                        "spread experts), one of fp16, bf16, topk:RATIO, randomk:RATIO, "
                        "powersgd:RANK (default: none)")
    p.add_argument("--trace", default=d.trace, metavar="PATH",
                   help="write a Chrome trace of the last step there; its folder must exist "
                        "and be writable, checked before any rank starts (default: none)")
    p.add_argument("--peak-tflops", type=float, default=d.peak_tflops,
                   help="peak TFLOP/s of one device for MFU (default: from the GPU's name "
                        "and the precision; none on a CPU)")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                   help="auto: NCCL when this machine has a GPU for each of its ranks, else "
                        "Gloo on the CPU (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seed of the model's initial weights, 0 to 2**32 - 1; the data's is "
                        "seed + 1 (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=d.timeout, metavar="SECONDS",
                   help="process-group timeout: a collective waiting longer for a lost peer "
                        f"fails, naming it; {MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:g} (a day) "
                        "(default: %(default)s)")
    p.add_argument("--allow-oversubscribe", action="store_true",
                   help="launch more Gloo ranks than this machine runs by default (4 per "
                        "core, at least 8: engine.train.checks.rank_limit); each rank is a "
                        "process of its own. NCCL needs a GPU per rank whatever this says, "
                        "and torchrun's world is never limited (default: %(default)s)")
    checkpointing = p.add_argument_group("checkpoints (engine.checkpoint.trainer)")
    checkpointing.add_argument("--save", default=d.save, metavar="DIR",
                               help="write sharded checkpoints under DIR/step-NNNNNNNN, each "
                                    "atomically, one after the last step; DIR is made at the "
                                    "first save, and where it will be must be writable, "
                                    "checked before any rank starts (default: none)")
    checkpointing.add_argument("--save-every", type=int, default=d.save_every, metavar="K",
                               help="also write one every K steps (default: only after the "
                                    "last)")
    checkpointing.add_argument("--keep", type=int, default=d.keep, metavar="N",
                               help="keep the newest N checkpoints (default: %(default)s)")
    checkpointing.add_argument("--async-save", action="store_true",
                               help="block the step only while the state is copied to host "
                                    "memory, and write it in a background thread; the next "
                                    "save and the run's end wait for the write "
                                    "(default: %(default)s)")
    checkpointing.add_argument("--resume", action="store_true",
                               help="continue from the newest complete checkpoint in --save "
                                    "(none yet: start at step 0, so a torchrun restart can "
                                    "use the same command) (default: %(default)s)")
    checkpointing.add_argument("--resume-fallback", action="store_true",
                               help="with --resume: when the newest checkpoint is damaged (its "
                                    "trainer.json or manifest malformed, a rank file missing or "
                                    "failing its SHA-256), resume from the newest complete one "
                                    "before it that loads, and say which; without it such a "
                                    "checkpoint stops the run with one line naming the file "
                                    "(default: %(default)s)")
    checkpointing.add_argument("--reshard", action="store_true",
                               help="with --resume: re-cut a checkpoint saved at another dp / "
                                    "cp / tp / pp / ZeRO layout for this one "
                                    "(engine.compose.reshard) (default: %(default)s)")
    lab = p.add_argument_group("failure injection, for labs and tests only "
                               "(engine.launch.elastic)")
    lab.add_argument("--kill-at-step", type=int, default=d.kill_at_step, metavar="K",
                     help="SIGKILL --kill-rank right after step K, on torchrun's first attempt "
                          "only, so that --max-restarts brings the run back (default: never)")
    lab.add_argument("--kill-rank", type=int, default=d.kill_rank, metavar="R",
                     help="the global rank --kill-at-step kills (default: the last)")
    return p


def parse(argv) -> tuple[TrainConfig, argparse.Namespace, set[str]]:
    """The configuration, the parsed arguments, and the names of those the learner gave."""
    p = parser()
    args = p.parse_args(argv)
    given = argparse.Namespace()
    for action in p._actions:  # a second pass with no defaults: only what argv sets is set
        action.default = argparse.SUPPRESS
    p.parse_args(argv, given)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    if cfg.model in MOE_MODELS and "zero" not in vars(given):
        cfg = replace(cfg, zero=0)  # an MoE run's default: no sharding, as it always was
    return cfg, args, set(vars(given))


def main(argv=None) -> int:
    """``python -m engine train ARGV``; its exit code. Every way it can end prints one line
    that says what to do next (:mod:`engine.train.endings`)."""
    from engine.launch.elastic import PeerLostError
    from engine.launch import LaunchEnv, is_global_rank_zero, launch

    argv = sys.argv[1:] if argv is None else list(argv)
    env = LaunchEnv.read()
    try:
        cfg, args, given = parse(argv)
        world = env.world_size if env.under_torchrun else (args.world_size or cfg.world_size)
        check_config(cfg, world)
        if cfg.dry_run:
            from engine.train.dry_run import dry_run_command

            return dry_run_command(cfg, world)
        # auto: NCCL when there is a GPU for every rank on this machine (under torchrun,
        # LOCAL_WORLD_SIZE: the same on every process), else Gloo
        here, named = (env.local_world_size, "LOCAL_WORLD_SIZE") if env.under_torchrun else \
            (world, "world_size")
        backend = resolve_backend(args.backend, here, named, prefer_nccl=True)
        check_world(cfg, world, backend, env.under_torchrun)
        check_paths(cfg, trace=is_global_rank_zero())  # only global rank 0 writes the trace
        if env.under_torchrun:
            from engine.launch.elastic import check_restartable, die_with_agent

            die_with_agent()  # an agent that dies takes its workers along: no orphans
            check_restartable()
        point = resume_point(cfg)
    except (ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        tell_torchrun(f"error: {e}")
        return 2
    if point is not None and point.step == total_steps(cfg):
        if is_global_rank_zero():
            print(f"{point.path} holds all {point.step} steps of this run: nothing to do "
                  f"(raise --steps to train on from it, or --save an empty directory to "
                  "start over)")
        return 0
    if is_global_rank_zero():
        print(f"training on {world} rank(s), {backend}...", flush=True)
    progress_fd, run = _progress_fd(backend), launch
    if env.under_torchrun:  # torchrun's summary then shows the worker's error, not a link
        from torch.distributed.elastic.multiprocessing.errors import record

        run = record(launch)
    handle, step_file = tempfile.mkstemp(prefix="engine-train-step-")
    os.close(handle)
    try:
        results = run(train_on_rank, world, cfg, point, progress_fd, env.under_torchrun,
                      step_file, backend=backend, timeout=cfg.timeout, deadline=False)
    except KeyboardInterrupt:
        if is_global_rank_zero():
            print(("\n" if sys.stderr.isatty() else "")
                  + interrupted(cfg, argv, read_step(step_file), env.under_torchrun),
                  file=sys.stderr, flush=True)
        return INTERRUPTED_EXIT
    except PeerLostError as e:  # under torchrun: the survivors say which peers are gone
        return lost_peer(e, env.rank)
    finally:
        if progress_fd is not None:
            os.close(progress_fd)
        os.unlink(step_file)
    if "stopped" in results[0]:  # a non-finite loss, a checkpoint that would not load
        return stopped(cfg, results[0], is_global_rank_zero())
    if is_global_rank_zero():
        decided = {"backend": backend, "precision": results[0]["precision"]}
        report(cfg, results, resolved(cfg, args, given, world, decided))
    return 0


def _progress_fd(backend: str) -> int | None:
    """This command's own stdout (a terminal, a pipe, a file), for forked ranks: rank 0 prints
    its progress there as it goes (a terminal gets a bar rewritten in place). None where the
    ranks' output must go through Python's ``sys.stdout`` (a notebook, pytest's capture: one
    line per step, printed after the run) or where they print directly (torchrun's
    workers; spawned NCCL ranks, which inherit no descriptor)."""
    from engine.launch import LaunchEnv

    try:
        live = backend == "gloo" and not LaunchEnv.read().under_torchrun and \
            sys.stdout is sys.__stdout__
        return os.dup(sys.stdout.fileno()) if live else None
    except (AttributeError, OSError, ValueError):  # a notebook's stdout has no descriptor
        return None


def run_on_gpus(args: list[str], gpus_needed: int) -> int | None:
    """For the notebooks' GPU-lab cells: with at least ``gpus_needed`` CUDA GPUs here, run
    ``python -m engine train ARGS --backend nccl`` now (one GPU per rank) and return its exit
    code; otherwise print the commands to run in the GPU lab and return None."""
    cfg, parsed, _ = parse(args)
    check_config(cfg, parsed.world_size or cfg.world_size)  # a wrong cell fails on a CPU too
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have >= gpus_needed:
        return main([*args, "--backend", "nccl"])
    options = " ".join(a for i, a in enumerate(args)  # torchrun sets the world size
                       if a != "--world-size" and (i == 0 or args[i - 1] != "--world-size"))
    print(f"{have} GPU(s) here; this cell needs {gpus_needed}. In the GPU lab:\n"
          f"  python -m engine train {' '.join(args)} --backend nccl\n"
          f"  torchrun --nproc-per-node {gpus_needed} -m engine train {options}")
    return None
