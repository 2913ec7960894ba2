"""A dry run: one training step of a real layout's code path, for chosen ranks of a world of
any size, on one CPU, with no memory and no network (torchtitan's dry run does the same).

Each chosen rank joins PyTorch's *fake* process group (``torch.testing._internal.distributed.
fake_pg``: every collective returns at once, nothing sent) as rank ``r`` of ``plan.world``;
the model is built on the **meta device** (shapes and dtypes, no storage); the engine then runs
what a real rank runs: :func:`engine.compose.parallelize.parallelize` (tensor, context and
expert parallelism, the pipeline split, the ZeRO stage) and one
:func:`engine.compose.loop.train_step` on the step's global batch, pipeline schedule
included. What comes out is counted, never computed from a formula:

* parameters, gradients and optimizer state, from the tensors the rank holds after the step
  (:func:`engine.observe.memory.model_state_bytes`, each storage once);
* activations: the most bytes autograd held for backward at once (a pipeline stage: its
  observer's peak over the schedule; otherwise one micro-batch's, as each backward frees its
  forward's before the next: :class:`engine.observe.memory.ActivationTracker`);
* bytes per group, from every collective the rank issued (:class:`engine.observe.meter.
  CommMeter`, as on the wire, by :func:`engine.compose.traffic.bytes_by_kind`);
* FLOPs of the step from ``torch.utils.flop_counter.FlopCounterMode``.

A meta tensor has no values, so the loss is nan; everything shape-driven is the real run's
(tests/test_dry_run.py compares a dry run with the same layout trained on Gloo ranks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from engine.compose.loop import train_step
from engine.compose.model import GPT, ModelConfig
from engine.compose.parallelize import parallelize
from engine.compose.plan import Plan
from engine.compose.traffic import bytes_by_kind
from engine.model.data import global_batch
from engine.observe.memory import ActivationTracker, model_state_bytes
from engine.observe.meter import CommMeter


# PyTorch's counter knows the GPU's fused attention kernels, not the CPU's flash kernel (what
# engine.model.attention.fast_causal_attention runs on CPUs and on the meta device): the same
# formulas (PyTorch's: both matrix products of every query with every key, causal or not)
def _flash_flops(query, key, value, *_, out_shape=None, **__) -> int:
    return sdpa_flop_count(query, key, value)


def _flash_backward_flops(grad_out, query, key, value, *_, out_shape=None, **__) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


_aten = torch.ops.aten
CPU_FLASH_FLOPS = {_aten._scaled_dot_product_flash_attention_for_cpu: _flash_flops,
                   _aten._scaled_dot_product_flash_attention_for_cpu_backward:
                       _flash_backward_flops}


@dataclass(frozen=True)
class RankCount:
    """What one rank of a dry run holds and sends in one step, counted."""

    rank: int
    coords: dict
    params: int  # parameters this rank holds (elements)
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # the most held for backward at once (module docstring)
    bytes_by_group: dict
    flops: int
    seconds: float

    @property
    def model_state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


@contextlib.contextmanager
def fake_rank(rank: int, world: int):
    """This process as rank ``rank`` of ``world`` on the fake process group (CPU and meta
    tensors), torn down after."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a dry run needs a process without a process group of its own")
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank,
                            world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def stage_ranks(plan: Plan) -> list[int]:
    """One rank per pipeline stage (the others differ only in which data or which slice of
    the heads they hold, not in their sizes): the rank at dp = cp = tp = 0 of each stage."""
    with fake_rank(0, plan.world):
        mesh = plan.mesh()
        return [rank for rank in range(plan.world)
                if all(v == 0 for k, v in dataclasses.asdict(mesh.coordinates(rank)).items()
                       if k != "pp")]


@contextlib.contextmanager
def per_micro_batch(module, params):
    """The bytes each forward of ``module`` (and the loss after it, until the next forward)
    saved for backward, in a list: one :class:`engine.observe.memory.ActivationTracker` a
    micro-batch, from one forward's start to the next's (a pipeline's runtime keeps its own)."""
    counted: list[int] = []
    tracker = None

    def close():
        nonlocal tracker
        if tracker is not None:
            tracker.__exit__(None, None, None)
            counted.append(tracker.bytes)
            tracker = None

    def start(*_):
        nonlocal tracker
        close()
        tracker = ActivationTracker(exclude=params).__enter__()

    handle = module.register_forward_pre_hook(start)
    try:
        yield counted
    finally:
        handle.remove()
        close()


def count_step(par, cfg: ModelConfig, rows: int, seed: int = 0) -> dict:
    """One :func:`engine.compose.loop.train_step` of ``par`` (a :class:`engine.compose.
    parallelize.Parallel`) on step 0's global batch of ``rows`` sequences, and what this rank
    held and sent, counted: the same code on the meta device (a dry run) and on real ranks."""
    held = list(par.model.parameters())
    batch = global_batch(0, rows, cfg.seq_len, cfg.vocab, seed + 1)
    with CommMeter(count="wire") as meter, \
            FlopCounterMode(display=False, custom_mapping=CPU_FLASH_FLOPS) as flops, \
            per_micro_batch(par.module, held) as saved:
        train_step(par, batch, 0)
    state = model_state_bytes(par.module, par.optimizer)
    if par.plan.pp > 1:  # the most a stage held at once, counted by the pipeline's observer
        activations = par.pipeline_run.peak_activation_bytes
    else:  # micro-batches one after another, each freed by its backward: the largest
        activations = max(saved, default=0)
    return dict(params=sum(p.numel() for p in set(held)), param_bytes=state.params,
                grad_bytes=state.grads, optimizer_bytes=state.optimizer,
                activation_bytes=activations,
                bytes_by_group=bytes_by_kind(meter.events, par.mesh, cfg.num_experts > 0),
                flops=flops.get_total_flops())


def count_rank(cfg: ModelConfig, plan: Plan, rank: int, rows: int, lr: float = 1e-4,
               seed: int = 0) -> RankCount:
    """Rank ``rank``'s dry run of one step of ``plan`` on ``rows`` sequences (the global
    batch) of ``cfg``'s GPT (module docstring)."""
    start = time.perf_counter()
    with fake_rank(rank, plan.world):
        mesh = plan.mesh()
        with torch.device("meta"):
            model = GPT(cfg, seed=seed)
        par = parallelize(model, mesh, plan, torch.optim.AdamW, lr=lr)
        counted = count_step(par, cfg, rows, seed)
        return RankCount(rank, dataclasses.asdict(mesh.coordinates(rank)), **counted,
                         seconds=time.perf_counter() - start)


GPUS = ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA B200")  # the fits column's


def size(nbytes: float) -> str:
    """``nbytes`` in binary units, three significant figures or more: 2.38 GiB, 115 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.3g} {unit}" \
                if nbytes < 100 else f"{nbytes:.0f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.0f} TiB"


def dry_run_command(cfg, world: int) -> int:
    """``python -m engine train --dry-run ...``: count one rank per pipeline stage of
    ``cfg``'s layout (its model, batch, ZeRO stage, schedule) and print the table; 0."""
    from engine import theory
    from engine.theory.hardware import GPU_SPECS
    from engine.train.composed import global_rows, model_config, plan_of

    plan, model = plan_of(cfg), model_config(cfg)
    rows = global_rows(cfg)
    ranks = stage_ranks(plan)
    print(f"dry run of {plan.name} on {world} rank(s), --model {cfg.model} "
          f"({model.layers} layers, hidden {model.hidden}, attention {model.attention}), "
          f"{rows} sequences of {model.seq_len} tokens a step; fake process group, meta "
          f"device; one rank per pipeline stage: {ranks}", flush=True)
    header = (f"{'rank':>6}{'stage':>6}{'params':>15}{'states':>11}{'formula':>11}"
              f"{'activations':>12}{'sent by group':>44}{'TFLOP':>9}  fits")
    lines = []
    for rank in ranks:
        c = count_rank(model, plan, rank, rows, lr=cfg.lr, seed=cfg.seed)
        formula = theory.zero_model_state_bytes(c.params, plan.dp * plan.cp, cfg.zero, k=8,
                                                param_bytes=4, grad_bytes=4)["total"]
        sent = " ".join(f"{k} {size(v)}" for k, v in c.bytes_by_group.items() if v)
        need = c.model_state_bytes + c.activation_bytes
        fits = ", ".join(name.split()[1] for name in GPUS
                         if need <= GPU_SPECS[name].memory_gb * 1e9) or "none of " + \
            ", ".join(name.split()[1] for name in GPUS)
        lines.append(f"{rank:>6}{c.coords['pp']:>6}{c.params:>15,}"
                     f"{size(c.model_state_bytes):>11}{size(formula):>11}"
                     f"{size(c.activation_bytes):>12}{sent:>44}{c.flops / 1e12:>9.1f}  "
                     f"{fits}  ({c.seconds:.1f} s)")
        print(lines[-1] if len(lines) > 1 else header + "\n" + lines[-1], flush=True)
    print("counted from the tensors each rank created and the collectives it issued; states "
          "are fp32 AdamW's (4 + 4 + 8 B a parameter; ZeRO's formula beside them, "
          "theory.zero_model_state_bytes: the counted adds bucket padding and AdamW's step "
          "counters); activations are the most held for backward at once, in fp32 (a bf16 "
          "run holds half; --attention written keeps every s x s score)")
    return 0
