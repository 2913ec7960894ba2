"""Checks for chapter 07: the 3D mesh's groups, and the planner's memory and step-time model."""

from __future__ import annotations

import math
import random

from engine.comm import ops
from engine.grading.core import CheckFailed, Exercise, passed, run_ranks
from engine.theory.planner import GPUS, MODELS, Cluster, memory_per_gpu, plan, step_time
from engine.topology import Mesh

KINDS = ("tp", "dp", "pp")

# -- ch07.mesh_groups -------------------------------------------------------------------------

REAL_LAYOUTS = [(2, 2, 2), (3, 2, 2), (1, 4, 2), (2, 1, 4)]  # (dp, tp, pp), run on real ranks
LARGE_LAYOUTS = [(4, 8, 4), (16, 8, 8), (3, 4, 5), (1, 1, 7), (6, 1, 1), (2, 8, 12)]


def _expected_groups(dp: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """The mesh's groups from its own numbering (``Mesh.coordinates``), no process needed: the
    ranks that share every coordinate but one, in rank order."""
    layout = Mesh.__new__(Mesh)  # only the numbering: no process group is built
    layout.dp, layout.tp, layout.pp, layout.cp, layout.ep = dp, tp, pp, 1, 1
    groups: dict[str, dict[tuple, list[int]]] = {kind: {} for kind in KINDS}
    for rank in range(dp * tp * pp):
        c = layout.coordinates(rank)
        groups["tp"].setdefault((c.dp, c.pp), []).append(rank)
        groups["dp"].setdefault((c.tp, c.pp), []).append(rank)
        groups["pp"].setdefault((c.dp, c.tp), []).append(rank)
    return {kind: sorted(by.values()) for kind, by in groups.items()}


def _answer(impl, dp, tp, pp) -> dict[str, list[list[int]]]:
    got = impl(dp, tp, pp)
    if not isinstance(got, dict) or sorted(got) != sorted(KINDS):
        raise CheckFailed(f"return a dict with keys {list(KINDS)}, got {got!r:.120}",
                          dp=dp, tp=tp, pp=pp)
    try:
        return {kind: [[int(r) for r in group] for group in got[kind]] for kind in KINDS}
    except (TypeError, ValueError):
        raise CheckFailed("each kind maps to a list of groups, each a list of ranks",
                          dp=dp, tp=tp, pp=pp) from None


def check_groups_equal_the_mesh_layout(impl):
    for dp, tp, pp in LARGE_LAYOUTS:
        got, expected = _answer(impl, dp, tp, pp), _expected_groups(dp, tp, pp)
        for kind in KINDS:
            size = {"tp": tp, "dp": dp, "pp": pp}[kind]
            counts = [sum(rank in g for g in got[kind]) for rank in range(dp * tp * pp)]
            if any(len(g) != size for g in got[kind]) or set(counts) != {1}:
                raise CheckFailed(
                    f"every rank is in exactly one {kind} group of {size} ranks; got "
                    f"{len(got[kind])} groups of sizes {sorted({len(g) for g in got[kind]})}",
                    dp=dp, tp=tp, pp=pp)
            if sorted(got[kind]) != expected[kind]:
                wrong = next(g for g in sorted(got[kind]) if g not in expected[kind])
                right = next(g for g in expected[kind] if g[0] == wrong[0])
                raise CheckFailed(
                    f"the {kind} group of rank {wrong[0]} is {wrong}; the mesh's is {right} "
                    "(rank = pp_index·dp·tp + dp_index·tp + tp_index, ranks in increasing "
                    "order)", dp=dp, tp=tp, pp=pp)
    return passed(f"{sum(len(g) for g in got.values())} groups at dp {dp} x tp {tp} x pp {pp}",
                  "dp·pp tp groups + tp·pp dp groups + dp·tp pp groups")


def _mesh_on_rank(rank, world_size, dp, tp, pp):
    mesh = Mesh(dp=dp, tp=tp, pp=pp)
    return {kind: list(ops.group_ranks(getattr(mesh, f"{kind}_group"))) for kind in KINDS}


def check_groups_equal_real_process_groups(impl):
    # the learner's function for every layout first: once the worker has answered, the
    # exercise's time limit cannot fire while the grader starts its own ranks below (no
    # learner's code in them; seconds on a loaded machine)
    answers = [((dp, tp, pp), _answer(impl, dp, tp, pp)) for dp, tp, pp in REAL_LAYOUTS]
    for (dp, tp, pp), got in answers:
        for rank, built in enumerate(run_ranks(_mesh_on_rank, dp * tp * pp, dp, tp, pp,
                                               timeout=30)):
            for kind in KINDS:
                mine = [g for g in got[kind] if rank in g]
                if mine != [built[kind]]:
                    raise CheckFailed(
                        f"rank {rank}'s {kind} group is {built[kind]} in the process groups "
                        f"Mesh builds; yours: {mine}", dp=dp, tp=tp, pp=pp)


# -- ch07.planner -----------------------------------------------------------------------------

DENSE_MODELS = [name for name, model in MODELS.items() if not model.is_moe]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _memory_cases(seed: int = 7, count: int = 30):
    rng = random.Random(seed)
    for _ in range(count):
        model = MODELS[rng.choice(DENSE_MODELS)]
        tp = rng.choice([t for t in _divisors(model.heads) if t <= 8 and model.hidden % t == 0])
        pp = rng.choice([p for p in _divisors(model.layers) if p <= 16])
        yield model, dict(dp=rng.choice([1, 2, 3, 8, 64]), tp=tp, pp=pp,
                          zero=rng.choice([0, 1, 2, 3]), micro_batch=rng.choice([1, 2, 4, 8]),
                          micro_batches=rng.choice([1, 2, 5, 16, 64]))


def check_memory_per_gpu(module):
    for model, layout in _memory_cases():
        expected = memory_per_gpu(model, **layout)["total"]
        got = module.memory_per_gpu(model, **layout)
        if not isinstance(got, (int, float)) or not math.isclose(got, expected, rel_tol=1e-9):
            parts = memory_per_gpu(model, **layout)
            raise CheckFailed(
                f"memory_per_gpu gives {got!r} bytes, the planner {expected:.6g} (model states "
                f"{parts['params'] + parts['grads'] + parts['optimizer']:.4g}, activations "
                f"{parts['activations']:.4g})", model=model.name, **layout)
    return passed(f"{expected / 1e9:.1f} GB for {model.name}", "engine.theory.planner's",
                  **{k: v for k, v in layout.items() if k in ("dp", "tp", "pp", "zero")})


def _cluster_cases(seed: int = 11, count: int = 6):
    rng = random.Random(seed)
    cases = [(MODELS["GPT-3 175B"], Cluster(8, **GPUS["A100 80GB"]), 64, 0.5)]  # none fits
    for _ in range(count):
        model = MODELS[rng.choice(DENSE_MODELS)]
        gpus = rng.choice([8, 16, 32, 64, 128])
        cluster = Cluster(gpus, **GPUS[rng.choice(sorted(GPUS))])
        batch = rng.choice([64, 128, 256, 512, 1536])
        cases.append((model, cluster, batch, rng.choice([0.3, 0.45, 0.5])))
    return cases


def _valid(model, cluster, global_batch, layout) -> str:
    """Why ``layout`` is not one the planner considers ('' if it is)."""
    dp, tp, pp, zero, mb = layout
    if dp * tp * pp != cluster.gpus:
        return f"dp x tp x pp = {dp * tp * pp}, not the {cluster.gpus} GPUs"
    if tp > cluster.gpus_per_node or model.heads % tp or model.hidden % tp:
        return f"tp = {tp} must stay in a node and divide the heads and the hidden size"
    if model.layers % pp:
        return f"pp = {pp} does not divide the {model.layers} layers"
    if mb not in (1, 2, 4, 8) or zero not in (0, 1, 2, 3) or global_batch % (dp * mb):
        return f"micro-batch {mb} (dp = {dp}) must divide the global batch {global_batch}"
    return ""


def check_fastest_layout(module):
    for model, cluster, global_batch, mfu in _cluster_cases():
        ranked = plan(model, cluster, global_batch, mfu=mfu)
        got = module.fastest_layout(model, cluster, global_batch, mfu)
        where = dict(model=model.name, gpus=cluster.gpus, memory_gb=cluster.memory_gb,
                     global_batch=global_batch, mfu=mfu)
        if not ranked:
            if got is not None:
                raise CheckFailed(f"no layout fits, but fastest_layout returned {got!r}; "
                                  "return None", **where)
            continue
        best = ranked[0]
        if not isinstance(got, tuple) or len(got) != 5:
            raise CheckFailed(f"return (dp, tp, pp, zero, micro_batch), got {got!r}; the "
                              f"planner picks {best.label()}", **where)
        why = _valid(model, cluster, global_batch, got)
        if why:
            raise CheckFailed(f"{got} is not a valid layout: {why}", **where)
        dp, tp, pp, zero, mb = got
        m = global_batch // (dp * mb)
        memory = memory_per_gpu(model, dp, tp, pp, zero, mb, m)["total"]
        time = step_time(model, cluster, dp, tp, pp, zero, mb, global_batch, mfu)["total"]
        if memory > 0.9 * cluster.memory_gb * 1e9:
            raise CheckFailed(f"{got} needs {memory / 1e9:.1f} GB per GPU: more than 90% of "
                              f"{cluster.memory_gb} GB", **where)
        if not (math.isclose(time, best.time["total"], rel_tol=1e-12)
                and math.isclose(memory, best.memory["total"], rel_tol=1e-12)):
            raise CheckFailed(
                f"{got} takes {time:.3f} s a step with {memory / 1e9:.1f} GB; the planner's "
                f"best, {best.label()}, takes {best.time['total']:.3f} s with "
                f"{best.memory['total'] / 1e9:.1f} GB", **where)
    return passed(f"{best.label()} at {best.time['total']:.2f} s a step",
                  "the planner's fastest that fits", model=model.name, gpus=cluster.gpus)


EXERCISES = [
    Exercise(
        name="ch07.mesh_groups",
        title="The 3D mesh: which ranks form each dp, tp and pp group",
        module="ch07_mesh_groups",
        attr="mesh_groups",
        checks=(check_groups_equal_the_mesh_layout, check_groups_equal_real_process_groups),
        hints=(
            "Give every rank its coordinates (dp index, tp index, pp index). A group of one "
            "kind is the ranks that agree on the two other coordinates: a tp group shares "
            "dp and pp, and so on. tp varies fastest, so tp groups are runs of consecutive "
            "ranks; dp groups stride by tp; pp groups by dp·tp.",
            "rank = p·dp·tp + d·tp + t with d in range(dp), t in range(tp), p in range(pp); "
            "a list comprehension over the two fixed coordinates, then the free one.",
            "rank = lambda d, t, p: p * dp * tp + d * tp + t; tp groups: [[rank(d, t, p) for t "
            "in range(tp)] for p in range(pp) for d in range(dp)]; dp groups: vary d for each "
            "(p, t); pp groups: vary p for each (d, t).",
        ),
        blocks=("engine.topology.Mesh.rank_sets", "engine.topology.Mesh.coordinates",
                "engine.topology.Mesh.rank_of"),
    ),
    Exercise(
        name="ch07.planner",
        title="The planner: memory per GPU, and the fastest layout that fits",
        module="ch07_planner",
        attr="",
        checks=(check_memory_per_gpu, check_fastest_layout),
        hints=(
            "Tensor and pipeline parallelism cut the model states by tp·pp; ZeRO shards them "
            "further over dp. Activations are not sharded by ZeRO: the first pipeline stage "
            "holds min(pp, m) micro-batches of its layers. The fastest layout is a search: "
            "enumerate every valid layout, keep those that fit, take the quickest step.",
            "theory.zero_model_state_bytes(params, dp, zero)['total']; "
            "theory.activation_bytes_per_layer(s, b, h, heads, tp, 1, False, True); "
            "step_time(model, cluster, dp, tp, pp, zero, micro_batch, global_batch, "
            "mfu)['total']; dp = gpus // (tp pp).",
            "for tp dividing gpus (in a node, dividing heads and hidden); for pp dividing "
            "gpus // tp and the layers; dp = gpus // (tp pp); for mb whose dp·mb divides the "
            "batch; for zero: memory = memory_per_gpu(...); skip if > 0.9 GPU; key = (time, "
            "memory); keep the smallest key's (dp, tp, pp, zero, mb).",
        ),
        blocks=("engine.theory.planner.plan", "engine.theory.planner.memory_per_gpu"),
    ),
]
