"""Checks for chapter 04: a ZeRO-1 step, the per-GPU memory formula; drills on 2 vs 3 psi.

The ranks that run the learner's code (the ``_on_rank`` drivers) return what they observed:
parameters, shards, the bytes the optimizer holds, the meter's events. The references
(DataParallel with Adam, the engine's ZeroDataParallel) run in ranks the grader starts without
the learner's code, and every comparison happens in the grader.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from engine import theory
from engine.observe.meter import CommMeter
from engine.dp import DataParallel
from engine.observe.memory import optimizer_tensors, unique_storage_bytes
from engine.model.mlp import MLP
from engine.model.data import regression_data, shard
from engine.zero import ZeroDataParallel
from engine.grading.core import CheckFailed, Exercise, passed, run_ranks
from engine.grading.drill import Drill

SIZES = (16, 33, 31, 8)  # 1871 parameters: padding needed at 2 and 3 ranks


def _batch(rank, world_size):
    x, y = regression_data(8 * world_size, 16, 8, seed=1)
    return shard(x, rank, world_size), shard(y, rank, world_size)


def _params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _zero1_reference_on_rank(rank, world_size):
    """The reference, in ranks started by the grader (never the learner's code): DataParallel
    with Adam, 3 steps; its parameters."""
    xs, ys = _batch(rank, world_size)
    ref = DataParallel(MLP(SIZES, seed=2))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for _ in range(3):
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(xs), ys).backward()
        ref_opt.step()
    return _params(ref)


@functools.lru_cache(maxsize=None)
def _zero1_reference(world_size: int) -> list[list[torch.Tensor]]:
    return run_ranks(_zero1_reference_on_rank, world_size, timeout=20)


def _zero1_on_rank(rank, world_size, impl):
    """A driver: 3 steps of the learner's optimizer; the parameters it left, the bytes its
    inner optimizer holds and the meter's events of the last step."""
    xs, ys = _batch(rank, world_size)
    model = MLP(SIZES, seed=2 + rank)
    opt = impl(model.parameters(), torch.optim.Adam, lr=1e-2)
    events = []
    for _ in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(model(xs), ys).backward()
        with CommMeter() as meter:
            opt.step()
        events = [(e.op, e.bytes_sent) for e in meter.events]
    state = unique_storage_bytes(optimizer_tensors(opt.inner))
    return _params(model), state, events


def _worst(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The largest difference between two lists of parameters (inf when they do not pair)."""
    if len(ours) != len(reference) or any(a.shape != b.shape for a, b in zip(ours, reference)):
        return float("inf")
    return max((a - b).abs().max().item() for a, b in zip(reference, ours, strict=True))


def check_equals_data_parallel_adam(impl):
    for world_size in (2, 3):
        reference = _zero1_reference(world_size)
        for rank, (params, _, _) in enumerate(run_ranks(_zero1_on_rank, world_size, impl,
                                                        timeout=20)):
            worst = _worst(params, reference[rank])
            if not worst <= 1e-6:
                raise CheckFailed(
                    f"after 3 steps rank {rank}'s parameters differ from DataParallel + Adam by "
                    f"{worst:.2e}: average the reduce-scattered slice (divide by N), and "
                    "all-gather the updated slices into bucket.flat", world_size=world_size)


def check_optimizer_state_is_one_nth(impl):
    psi = sum(p.numel() for p in MLP(SIZES).parameters())
    for world_size in (2, 3):
        owned = math.ceil(psi / world_size)
        expected = 8 * owned + 4  # Adam's exp_avg and exp_avg_sq, fp32, plus its step counter
        for rank, (_, state, _) in enumerate(run_ranks(_zero1_on_rank, world_size, impl,
                                                    timeout=20)):
            if state != expected:
                raise CheckFailed(
                    f"rank {rank}'s Adam holds {state} bytes of state; owning 1/{world_size} "
                    f"of {psi} parameters it should hold {expected} (8 bytes per owned "
                    "element + the step counter). Step only self.inner, on self.master",
                    world_size=world_size)


def check_sends_what_one_all_reduce_sends(impl):
    psi = sum(p.numel() for p in MLP(SIZES).parameters())
    for world_size in (2, 3):
        padded = math.ceil(psi / world_size) * world_size
        expected = [("reduce_scatter", theory.ring_reduce_scatter_bytes(4 * padded, world_size)),
                    ("all_gather", theory.ring_all_gather_bytes(4 * padded, world_size))]
        for rank, (_, _, events) in enumerate(run_ranks(_zero1_on_rank, world_size, impl,
                                                     timeout=20)):
            if events != expected:
                raise CheckFailed(
                    f"rank {rank}'s step sent {events}; ZeRO-1 is one reduce-scatter of the "
                    "gradients and one all-gather of the parameters, through engine.comm.ops: "
                    f"{expected}", world_size=world_size)


HIDDEN = [(7.5e9, 64, s, "mixed") for s in range(4)] + \
    [(1.3e9, 8, s, "fp32") for s in range(4)] + [(175e9, 1024, 3, "mixed"), (1e6, 1, 2, "fp32")]


def check_per_gpu_bytes(module):
    for psi, n, stage, precision in HIDDEN:
        formula = {} if precision == "mixed" else dict(param_bytes=4, grad_bytes=4, k=8)
        expected = theory.zero_model_state_bytes(psi, n, stage, **formula)["total"]
        got = module.bytes_per_gpu(psi, n, stage, precision)
        if not math.isclose(got, expected, rel_tol=1e-9):
            raise CheckFailed(f"wrong for a hidden configuration at stage {stage}, {precision}: "
                              f"got {got:.4g} bytes. Stage s shards the first s of: optimizer "
                              "state, gradients, parameters")


EXERCISES = [
    Exercise(
        name="ch04.zero1_step",
        title="A ZeRO-1 optimizer step",
        module="ch04_zero1_step",
        attr="Zero1",
        checks=(check_equals_data_parallel_adam, check_optimizer_state_is_one_nth,
                check_sends_what_one_all_reduce_sends),
        hints=(
            "Each rank updates only the 1/N of the parameters it owns. It needs the average "
            "gradient of that slice alone, and afterwards every rank needs every rank's updated "
            "slice.",
            "self.bucket.flatten_grads() packs the gradients like the flat buffer; "
            "ops.reduce_scatter_tensor(out, full, group=...) leaves this rank the sum of its "
            "slice; ops.all_gather_into_tensor(self.bucket.flat, shard_copy, group=...) brings "
            "every slice back; self.inner steps self.master.",
            "full = self.bucket.flatten_grads(); mine = torch.empty_like(self.bucket.shard); "
            "reduce-scatter full into mine; self.master.grad = mine / N; self.inner.step(); "
            "all-gather self.bucket.shard.clone() into self.bucket.flat.",
        ),
        blocks=("engine.zero.optimizer.ZeroOptimizer.__init__",
                "engine.zero.optimizer.ZeroOptimizer.step",
                "engine.zero.optimizer.ZeroOptimizer._average_gradients"),
    ),
    Exercise(
        name="ch04.memory_formula",
        title="Model-state bytes per GPU under ZeRO",
        module="ch04_memory_formula",
        attr="",
        checks=(check_per_gpu_bytes,),
        hints=(
            "Count bytes per parameter in three parts: parameters, gradients, optimizer state. "
            "Each ZeRO stage shards one more part over the N GPUs: stage 1 the optimizer state, "
            "stage 2 the gradients too, stage 3 the parameters too.",
            "Mixed precision: 2 + 2 + 12 bytes per parameter (fp16 parameter and gradient; fp32 "
            "master, momentum and variance); fp32: 4 + 4 + 8. Only arithmetic.",
            "psi * (params / (N if stage >= 3 else 1) + grads / (N if stage >= 2 else 1) + "
            "optimizer / (N if stage >= 1 else 1)).",
        ),
        blocks=("engine.theory.zero_model_state_bytes",),
    ),
]

DRILLS = [  # questions from engine.drill's bank: the answers are computed, not typed
    Drill("ch04.zero3_vs_zero2_traffic", "zero3-doubles"),
    Drill("ch04.zero_saving", "zero-saving"),
    Drill("ch04.zero_bytes", "zero-bytes"),
]


# -- ch04.zero3_hooks -------------------------------------------------------------------------

def _units_gathered(model) -> int:
    return sum(u.full is not None for u in model.all_units)


def _zero3_reference_on_rank(rank, world_size):
    """The reference, in ranks started by the grader (never the learner's code): the engine's
    ZeroDataParallel, 3 steps; each unit's shard after each step, and each unit's padded
    size."""
    xs, ys = _batch(rank, world_size)
    reference = ZeroDataParallel(MLP(SIZES, seed=2 + rank), torch.optim.AdamW, lr=1e-2)
    shards = []
    for _ in range(3):
        reference.optimizer.zero_grad()
        with CommMeter():  # metered, ops run the engine's own collectives, as in the driver
            nn.functional.mse_loss(reference(xs), ys).backward()
            reference.optimizer.step()
        shards.append([u.shard.clone() for u in reference.all_units])
    return dict(shards=shards, padded=[u.padded for u in reference.all_units])


@functools.lru_cache(maxsize=None)
def _zero3_reference(world_size: int) -> list[dict]:
    return run_ranks(_zero3_reference_on_rank, world_size, timeout=20)


def _zero3_on_rank(rank, world_size, impl):
    """A driver: 3 steps of the learner's class; after each, its shards, the units still
    gathered, the parameters not empty and the meter's events; the most units gathered at
    once."""
    xs, ys = _batch(rank, world_size)
    ours = impl(MLP(SIZES, seed=2 + rank), torch.optim.AdamW, lr=1e-2)
    most = [0]  # the most units gathered at once, seen from hooks that run after the learner's

    def look(*_):
        most[0] = max(most[0], _units_gathered(ours))

    for layer in ours.module.modules():
        if isinstance(layer, nn.Linear):
            layer.register_forward_pre_hook(look)
            layer.register_forward_hook(look)
    for p in ours.module.parameters():
        p.register_post_accumulate_grad_hook(look)
    steps = []
    for _ in range(3):
        ours.optimizer.zero_grad()
        with CommMeter() as meter:
            nn.functional.mse_loss(ours(xs), ys).backward()
            ours.optimizer.step()
        steps.append(dict(
            shards=[u.shard.clone() for u in ours.all_units],
            gathered=[u.name for u in ours.all_units if u.full is not None],
            whole=[name for name, p in ours.module.named_parameters() if p.numel()],
            events=[(e.op, e.bytes_sent) for e in meter.events]))
    return dict(steps=steps, most=most[0])


def _run_zero3(impl, world_size):
    return run_ranks(_zero3_on_rank, world_size, impl, timeout=20)


def _same(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> bool:
    return len(ours) == len(reference) and all(
        a.shape == b.shape and torch.equal(a, b) for a, b in zip(reference, ours, strict=True))


def check_equals_zero_data_parallel(impl):
    for world_size in (2, 3):
        reference = _zero3_reference(world_size)
        for rank, res in enumerate(_run_zero3(impl, world_size)):
            for step, seen in enumerate(res["steps"]):
                if not _same(seen["shards"], reference[rank]["shards"][step]):
                    raise CheckFailed(
                        f"after step {step + 1} rank {rank}'s parameter shards differ from the "
                        "engine's ZeroDataParallel: is every unit gathered before its forward "
                        "and again before its backward?", world_size=world_size)


def check_holds_only_shards(impl):
    for world_size in (2, 3):
        for rank, res in enumerate(_run_zero3(impl, world_size)):
            for step, seen in enumerate(res["steps"]):
                if seen["gathered"] or seen["whole"]:
                    raise CheckFailed(
                        f"after step {step + 1} rank {rank} still holds whole parameters "
                        f"(units gathered: {seen['gathered']}; parameters not empty: "
                        f"{seen['whole']}); between steps a rank holds only its shards: free "
                        "each unit once its reduce-scatter is launched", world_size=world_size)
            if res["most"] > 1:
                raise CheckFailed(
                    f"rank {rank} held {res['most']} units gathered at once; without prefetch "
                    "it is one: free each unit right after its forward (and its backward)",
                    world_size=world_size)


def check_sends_3_n_minus_1_over_n_psi(impl):
    for world_size in (2, 3):
        reference = _zero3_reference(world_size)
        for rank, res in enumerate(_run_zero3(impl, world_size)):
            # fp32, each unit padded to a multiple of N (the engine's units, in the grader)
            size = 4 * sum(reference[rank]["padded"])
            expected = (2 * theory.ring_all_gather_bytes(size, world_size)
                        + theory.ring_reduce_scatter_bytes(size, world_size))
            for step, seen in enumerate(res["steps"]):
                ops_seen = sorted({op for op, _ in seen["events"]})
                sent = sum(b for _, b in seen["events"])
                if ops_seen != ["all_gather", "reduce_scatter"] or sent != expected:
                    raise CheckFailed(
                        f"rank {rank}, step {step + 1}: sent {sent} bytes by {ops_seen}; ZeRO-3 "
                        "gathers every unit twice (forward, backward) and reduce-scatters its "
                        f"gradients once: 3(N-1)/N x {size} = {expected:.0f} bytes",
                        world_size=world_size)
    return passed(f"sent {sent / size:.2f} x the padded parameter bytes", "3(N-1)/N",
                  N=world_size)


EXERCISES.append(Exercise(
    name="ch04.zero3_hooks",
    title="ZeRO-3: gather and free around each unit's forward and backward",
    module="ch04_zero3_hooks",
    attr="Zero3",
    checks=(check_equals_zero_data_parallel, check_holds_only_shards,
            check_sends_3_n_minus_1_over_n_psi),
    hints=(
        "A unit's parameters exist in full only while the unit computes: gathered just before "
        "its forward and freed just after; gathered again just before its backward (a hook "
        "on its output's gradient fires then) and freed once its gradients have been handed "
        "to the reduce-scatter. Two gathers and one reduce-scatter per unit per step.",
        "self._gather(unit, event) and self._free(unit, event); output.register_hook(fn) with "
        "fn(grad) returning grad; self.launcher.end.queue(); self.launcher.bucket_of[p]; "
        "unit.accumulate_grad(p); self.launcher.grad_ready(p); unit.work.",
        "_before_forward: gather. _after_forward: free; t.register_hook(lambda g: "
        "self._before_backward(unit) or g) on the first output that requires grad. "
        "_before_backward: launcher.end.queue(); gather. _on_grad_ready: unit = "
        "bucket_of[p]; unit.accumulate_grad(p); launcher.grad_ready(p); if unit.work is not "
        "None: free.",
    ),
    blocks=("engine.zero.stage3.ZeroDataParallel._before_forward",
            "engine.zero.stage3.ZeroDataParallel._after_forward",
            "engine.zero.stage3.ZeroDataParallel._before_backward",
            "engine.zero.stage3.ZeroDataParallel._on_grad_ready"),
))
