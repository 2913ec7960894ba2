"""The exercises for every idea a chapter measures (DDP's overlap hook, PowerSGD's step,
ZeRO-3's gather and free, the vocabulary-parallel loss, interleaved 1F1B, B and W of a linear
layer, the 3D mesh, the planner): each check fails on plausible wrong answers, each aimed at
one mistake, and on the engine's own answer, which is switched off while the exercise is
graded. That every check passes on ``solutions/`` and fails on the untouched stub is proved
for every exercise by tests/test_grading.py."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.comm import ops
from engine.compress.powersgd import orthogonalize
from engine.grading import registry, run_checks

NEW_EXERCISES = ("ch02.overlap_hook", "ch03.powersgd_step", "ch04.zero3_hooks",
                 "ch05.vocab_parallel_ce", "ch06.interleaved", "ch06.linear_b_w",
                 "ch07.mesh_groups", "ch07.planner")
MUTANTS: dict[str, list] = {}  # exercise -> [(wrong answer, the checks it must fail)]


def _failing(name: str, impl) -> set[str]:
    return {r.name for r in run_checks(name, impl=impl).results if not r.passed}


def _messages(name: str, impl) -> list[str]:
    return [r.message for r in run_checks(name, impl=impl).results]


def test_the_new_exercises_are_registered_with_three_hints_and_blocks():
    exercises = registry()
    for name in NEW_EXERCISES:
        exercise = exercises[name]
        assert len(exercise.hints) == 3 and len(set(exercise.hints)) == 3, name
        assert exercise.blocks, name


# -- ch02.overlap_hook ------------------------------------------------------------------------

def _launch_when_complete(p, buckets, bucket_of, launch):
    """Launches a bucket as soon as it is complete, not in bucket order."""
    bucket = bucket_of[p]
    bucket.view_of(p, bucket.buffer).copy_(p.grad)
    bucket.ready.add(p)
    if bucket.complete and bucket.work is None:
        bucket.work = launch(bucket)


def _never_launches(p, buckets, bucket_of, launch):
    """Fills the buckets but leaves every launch to the end of backward: no overlap."""
    bucket = bucket_of[p]
    bucket.view_of(p, bucket.buffer).copy_(p.grad)
    bucket.ready.add(p)


def _forgets_the_copy(p, buckets, bucket_of, launch):
    """Launches in order, but the buffer holds last step's values."""
    bucket_of[p].ready.add(p)
    for b in buckets:
        if not b.complete:
            break
        if b.work is None:
            b.work = launch(b)


MUTANTS["ch02.overlap_hook"] = [
    (_launch_when_complete, {"launched_in_order_during_backward"}),
    (_never_launches, {"launched_in_order_during_backward"}),
    (_forgets_the_copy, {"equals_engine_data_parallel"}),
]


@pytest.mark.parametrize("impl, failing", MUTANTS["ch02.overlap_hook"])
def test_overlap_hook_checks_catch_wrong_answers(impl, failing):
    assert _failing("ch02.overlap_hook", impl) == failing


# -- ch03.powersgd_step -----------------------------------------------------------------------

def _powersgd(feedback=True, divide=True, orthogonal=True, dense=False, in_place=False):
    def step(grad, q, error, group=None):
        matrix = grad.add_(error) if in_place else (grad + error if feedback else grad)
        if dense:  # the whole matrix on the wire: exact, and n x m numbers
            approx = matrix.clone()
            ops.all_reduce(approx, group=group)
            approx /= dist.get_world_size(group)
        else:
            p = matrix @ q
            ops.all_reduce(p, group=group)
            if orthogonal:
                orthogonalize(p)
            q.copy_(matrix.t() @ p)
            ops.all_reduce(q, group=group)
            if divide:
                q /= dist.get_world_size(group)
            approx = p @ q.t()
        if feedback:
            error.copy_(matrix - approx)
        return approx
    return step


MUTANTS["ch03.powersgd_step"] = [
    (dict(feedback=False), {"equals_engine_powersgd"}),
    (dict(divide=False), {"equals_engine_powersgd"}),
    (dict(orthogonal=False), {"equals_engine_powersgd"}),
    (dict(in_place=True), {"equals_engine_powersgd"}),
    (dict(dense=True), {"equals_engine_powersgd", "sends_n_plus_m_times_r"}),
]


@pytest.mark.parametrize("variant, failing", MUTANTS["ch03.powersgd_step"])
def test_powersgd_checks_catch_wrong_answers(variant, failing):
    assert _failing("ch03.powersgd_step", _powersgd(**variant)) == failing


# -- ch04.zero3_hooks -------------------------------------------------------------------------

def _zero3_variant(free_after_forward=True, free_after_backward=True, gather_for_backward=True):
    from solutions.ch04_zero3_hooks import Zero3

    class Variant(Zero3):
        def _after_forward(self, unit, output):
            if free_after_forward:
                self._free(unit, "after forward")
            output.register_hook(lambda grad: self._before_backward(unit) or grad)

        def _before_backward(self, unit):
            self.launcher.end.queue()
            if gather_for_backward:
                self._gather(unit, "backward")

        def _on_grad_ready(self, p):
            unit = self.launcher.bucket_of[p]
            unit.accumulate_grad(p)
            self.launcher.grad_ready(p)
            if free_after_backward and unit.work is not None:
                self._free(unit, "after backward")

    return Variant


MUTANTS["ch04.zero3_hooks"] = [
    # the forward's gather is kept for backward: 2(N-1)/N on the wire, every unit held at once
    (dict(free_after_forward=False), {"holds_only_shards", "sends_3_n_minus_1_over_n_psi"}),
    # freed only at the end of backward: each unit stays gathered while earlier ones run
    (dict(free_after_backward=False), {"holds_only_shards"}),
    # backward on empty parameters: an error in every check
    (dict(gather_for_backward=False), {"equals_zero_data_parallel", "holds_only_shards",
                                       "sends_3_n_minus_1_over_n_psi"}),
]


@pytest.mark.parametrize("variant, failing", MUTANTS["ch04.zero3_hooks"])
def test_zero3_checks_catch_wrong_answers(variant, failing):
    assert _failing("ch04.zero3_hooks", _zero3_variant(**variant)) == failing


# -- ch05.vocab_parallel_ce -------------------------------------------------------------------

def _gathers_the_logits(logits, targets, group=None):
    from engine.tp.mappings import gather_from_tp

    whole = gather_from_tp(logits, group)
    return F.cross_entropy(whole.reshape(-1, whole.shape[-1]), targets.reshape(-1),
                           reduction="none").view(targets.shape)


def _vocab_ce(subtract_max=True, mask_others=True):
    from engine.tp.mappings import reduce_from_tp

    def loss(logits, targets, group=None):
        shifted = logits
        if subtract_max:
            top = logits.detach().max(-1).values
            ops.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            shifted = logits - top.unsqueeze(-1)
        total = reduce_from_tp(shifted.exp().sum(-1), group)
        local = targets - dist.get_rank(group) * logits.shape[-1]
        mine = (local >= 0) & (local < logits.shape[-1])
        if not mask_others:  # every rank adds the logit at its clamped index
            mine = torch.ones_like(mine)
        index = local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
        picked = shifted.gather(-1, index).squeeze(-1).masked_fill(~mine, 0.0)
        return total.log() - reduce_from_tp(picked, group)
    return loss


MUTANTS["ch05.vocab_parallel_ce"] = [
    (_gathers_the_logits, {"never_gathers_the_logits"}),
    (_vocab_ce(subtract_max=False), {"matches_dense_cross_entropy"}),  # exp(90) is inf
    (_vocab_ce(mask_others=False), {"matches_dense_cross_entropy"}),
    (_vocab_ce(), set()),  # g (reduce_from_tp) instead of a Function: also right
]


@pytest.mark.parametrize("impl, failing", MUTANTS["ch05.vocab_parallel_ce"])
def test_vocab_parallel_ce_checks_catch_wrong_answers(impl, failing):
    module = types.SimpleNamespace(vocab_parallel_cross_entropy=impl)
    assert _failing("ch05.vocab_parallel_ce", module) == failing


# -- ch06.interleaved -------------------------------------------------------------------------

def _interleaved(warmup_rule="megatron", reverse_chunks=True):
    def schedule(p, m, v):
        total = m * v

        def forward(k):
            return (k // (p * v)) * p + k % p, (k // p) % v

        def backward(k):
            chunk = (k // p) % v
            return (k // (p * v)) * p + k % p, v - 1 - chunk if reverse_chunks else chunk

        out = {}
        for s in range(p):
            if warmup_rule == "1f1b":  # 1F1B's warm-up, blind to the chunks
                warmup = min(p - s - 1, total)
            elif warmup_rule == "no m == p case":
                warmup = min(2 * (p - s - 1) + (v - 1) * p, total)
            else:
                warmup = total if m == p else min(2 * (p - s - 1) + (v - 1) * p, total)
            actions = [("F", *forward(k)) for k in range(warmup)]
            for i in range(total - warmup):
                actions += [("F", *forward(warmup + i)), ("B", *backward(i))]
            actions += [("B", *backward(i)) for i in range(total - warmup, total)]
            out[s] = actions
        return out
    return schedule


MUTANTS["ch06.interleaved"] = [
    # backwards through the chunks in forward order: a B before its own F's dependency
    (_interleaved(reverse_chunks=False), {"interleaved_valid_and_deadlock_free",
                                          "interleaved_bubble_is_the_formula",
                                          "interleaved_is_megatrons_order"}),
    (_interleaved(warmup_rule="1f1b"), {"interleaved_valid_and_deadlock_free",
                                        "interleaved_bubble_is_the_formula",
                                        "interleaved_is_megatrons_order"}),
    (_interleaved(warmup_rule="no m == p case"), {"interleaved_is_megatrons_order"}),
]


@pytest.mark.parametrize("impl, failing", MUTANTS["ch06.interleaved"])
def test_interleaved_checks_catch_wrong_answers(impl, failing):
    assert _failing("ch06.interleaved", impl) == failing


# -- ch06.linear_b_w --------------------------------------------------------------------------

def _linear(b=None, w=None):
    import solutions.ch06_linear_b_w as good

    return types.SimpleNamespace(linear_b=b or good.linear_b, linear_w=w or good.linear_w)


def _w_for_2d_inputs_only(x, grad_out):
    return grad_out.transpose(-1, -2) @ x, grad_out.sum(0)  # batched for 3-D: wrong shapes


def _w_transposed(x, grad_out):
    dy, xs = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
    return xs.t() @ dy, dy.sum(0)


def _b_that_resets_the_weight_grad(grad_out, weight):
    weight.grad = None  # "W will fill it in": but W of earlier micro-batches already did
    return grad_out @ weight


MUTANTS["ch06.linear_b_w"] = [
    (_linear(w=_w_for_2d_inputs_only), {"b_and_w_equal_autograd",
                                         "zero_bubble_runtime_w_after_b"}),
    (_linear(w=_w_transposed), {"b_and_w_equal_autograd", "zero_bubble_runtime_w_after_b"}),
    (_linear(b=_b_that_resets_the_weight_grad), {"zero_bubble_runtime_w_after_b"}),
]


@pytest.mark.parametrize("impl, failing", MUTANTS["ch06.linear_b_w"])
def test_linear_b_w_checks_catch_wrong_answers(impl, failing):
    assert _failing("ch06.linear_b_w", impl) == failing


# -- ch07.mesh_groups -------------------------------------------------------------------------

def _mesh(order="tp dp pp"):
    def groups(dp, tp, pp):
        sizes = {"tp": tp, "dp": dp, "pp": pp}
        fastest = order.split()

        def rank(coords):  # the first kind in `order` varies fastest
            r, stride = 0, 1
            for kind in fastest:
                r += coords[kind] * stride
                stride *= sizes[kind]
            return r

        everything = [dict(tp=t, dp=d, pp=p) for p in range(pp) for d in range(dp)
                      for t in range(tp)]
        out = {}
        for kind in ("tp", "dp", "pp"):
            by_rest: dict[tuple, list[int]] = {}
            for c in everything:
                rest = tuple(c[k] for k in sizes if k != kind)
                by_rest.setdefault(rest, []).append(rank(c))
            out[kind] = [sorted(g) for g in by_rest.values()]
        return out
    return groups


MUTANTS["ch07.mesh_groups"] = [
    (_mesh("dp tp pp"), {"groups_equal_the_mesh_layout", "groups_equal_real_process_groups"}),
    (_mesh("tp pp dp"), {"groups_equal_the_mesh_layout", "groups_equal_real_process_groups"}),
    (lambda dp, tp, pp: {k: [list(range(dp * tp * pp))] for k in ("tp", "dp", "pp")},
     {"groups_equal_the_mesh_layout", "groups_equal_real_process_groups"}),
]


@pytest.mark.parametrize("impl, failing", MUTANTS["ch07.mesh_groups"])
def test_mesh_groups_checks_catch_wrong_answers(impl, failing):
    assert _failing("ch07.mesh_groups", impl) == failing


def test_mesh_groups_check_names_the_wrong_group():
    message = _messages("ch07.mesh_groups", _mesh("dp tp pp"))[0]
    assert "the tp group of rank" in message and "the mesh's is" in message


# -- ch07.planner -----------------------------------------------------------------------------

def _planner(memory=None, fastest=None):
    import solutions.ch07_planner as good

    module = types.SimpleNamespace(memory_per_gpu=memory or good.memory_per_gpu,
                                   fastest_layout=fastest or good.fastest_layout)
    return module


def _memory_without_zero(model, dp, tp, pp, zero, micro_batch, micro_batches):
    from engine import theory

    states = 16 * model.params / (tp * pp)  # forgets the ZeRO stage
    per_layer = theory.activation_bytes_per_layer(model.seq_len, micro_batch, model.hidden,
                                                  model.heads, tp, 1, False, True)
    return states + min(pp, micro_batches) * model.layers / pp * per_layer


def _memory_all_micro_batches(model, dp, tp, pp, zero, micro_batch, micro_batches):
    from engine import theory

    states = theory.zero_model_state_bytes(model.params / (tp * pp), dp, zero)["total"]
    per_layer = theory.activation_bytes_per_layer(model.seq_len, micro_batch, model.hidden,
                                                  model.heads, tp, 1, False, True)
    return states + micro_batches * model.layers / pp * per_layer  # GPipe's, not 1F1B's


def _fastest_ignoring_memory(model, cluster, global_batch, mfu=0.5):
    import solutions.ch07_planner as good

    return good.fastest_layout(model, types.SimpleNamespace(
        gpus=cluster.gpus, gpus_per_node=cluster.gpus_per_node, memory_gb=1e9,
        **{k: getattr(cluster, k) for k in ("peak_tflops", "intra_gbps", "inter_gbps",
                                            "alpha_intra", "alpha_inter")}),
        global_batch, mfu)


def _least_memory(model, cluster, global_batch, mfu=0.5):
    """Picks the leanest layout that fits, not the fastest."""
    import solutions.ch07_planner as good  # its memory_per_gpu: the engine's is switched off

    best, best_memory = None, None
    for tp in (1, 2, 4, 8):
        for pp in range(1, cluster.gpus + 1):
            if cluster.gpus % (tp * pp) or model.layers % pp or model.heads % tp:
                continue
            dp = cluster.gpus // (tp * pp)
            for mb in good.MICRO_BATCH_SIZES:
                if global_batch % (dp * mb):
                    continue
                for zero in good.ZERO_STAGES:
                    memory = good.memory_per_gpu(model, dp, tp, pp, zero, mb,
                                                 global_batch // (dp * mb))
                    if memory > (1 - good.RESERVE) * cluster.memory_gb * 1e9:
                        continue  # the leanest layout that fits
                    if best is None or memory < best_memory:
                        best, best_memory = (dp, tp, pp, zero, mb), memory
    return best


MUTANTS["ch07.planner"] = [
    (_planner(memory=_memory_without_zero), {"memory_per_gpu"}),
    (_planner(memory=_memory_all_micro_batches), {"memory_per_gpu"}),
    (_planner(fastest=_fastest_ignoring_memory), {"fastest_layout"}),
    (_planner(fastest=_least_memory), {"fastest_layout"}),
]


@pytest.mark.parametrize("impl, failing", MUTANTS["ch07.planner"])
def test_planner_checks_catch_wrong_answers(impl, failing):
    assert _failing("ch07.planner", impl) == failing


# -- the engine's own answer is switched off ----------------------------------------------------

def _engine_launcher(p, buckets, bucket_of, launch):
    from engine.dp.buckets import BucketLauncher, EndOfBackward

    bucket = bucket_of[p]
    bucket.view_of(p, bucket.buffer).copy_(p.grad)
    state = types.SimpleNamespace(buckets=buckets, ordered=True, _launch=launch,
                                  bucket_of=bucket_of, end=EndOfBackward(lambda: None))
    BucketLauncher.grad_ready(state, p)


def _engine_powersgd(grad, q, error, group=None):
    from engine.compress import PowerSGD
    from engine.dp.buckets import GradBucket

    bucket = GradBucket([torch.nn.Parameter(torch.zeros_like(grad))], is_last=True)
    bucket.buffer = grad.reshape(-1).clone()
    PowerSGD(rank=q.shape[1], start_iter=0)(bucket, group).wait()
    return bucket.buffer.view_as(grad)


def _engine_zero3():
    from solutions.ch04_zero3_hooks import Zero3
    from engine.zero import ZeroDataParallel

    class CallsTheEngine(Zero3):
        def _before_forward(self, unit):
            ZeroDataParallel._before_forward(self, unit)

    return CallsTheEngine


def _engine_vocab_ce(logits, targets, group=None):
    from engine.tp.layers import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits, targets, group)


def _engine_interleaved(p, m, v):
    from engine.pp import interleaved_1f1b

    return interleaved_1f1b(p, m, v)


def _engine_linear():
    from engine.pp import weight_grad

    return types.SimpleNamespace(
        linear_b=lambda grad_out, weight: weight_grad.linear_input_grad(grad_out, weight),
        linear_w=lambda x, grad_out: weight_grad.linear_weight_grad(x, grad_out))


def _engine_mesh(dp, tp, pp):
    from engine.topology import Mesh

    layout = Mesh.__new__(Mesh)
    layout.dp, layout.tp, layout.pp, layout.cp, layout.ep = dp, tp, pp, 1, 1
    return {name: layout.rank_sets(name) for name in ("tp", "dp", "pp")}


def _engine_planner():
    from engine.theory import planner  # its functions looked up when called, as a learner's would be

    def fastest(model, cluster, global_batch, mfu=0.5):
        best = planner.plan(model, cluster, global_batch, mfu=mfu)
        return (best[0].dp, best[0].tp, best[0].pp, best[0].zero, best[0].micro_batch) \
            if best else None

    return types.SimpleNamespace(
        fastest_layout=fastest,
        memory_per_gpu=lambda *args, **kwargs: planner.memory_per_gpu(*args, **kwargs)["total"])


@pytest.mark.parametrize("name, impl", [
    ("ch02.overlap_hook", _engine_launcher),
    ("ch03.powersgd_step", _engine_powersgd),
    ("ch04.zero3_hooks", _engine_zero3()),
    ("ch05.vocab_parallel_ce",
     types.SimpleNamespace(vocab_parallel_cross_entropy=_engine_vocab_ce)),
    ("ch06.interleaved", _engine_interleaved),
    ("ch06.linear_b_w", _engine_linear()),
    ("ch07.mesh_groups", _engine_mesh),
    ("ch07.planner", _engine_planner()),
])
def test_calling_the_engines_own_answer_fails_every_check(name, impl):
    messages = _messages(name, impl)
    assert messages and all("switched off" in m for m in messages), messages


def test_every_check_of_the_new_exercises_is_failed_by_some_wrong_answer():
    """The wrong answers above, together, fail every check of every new exercise."""
    assert sorted(MUTANTS) == sorted(NEW_EXERCISES)
    for name in NEW_EXERCISES:
        checks = {fn.__name__.removeprefix("check_") for fn in registry()[name].checks}
        caught = set().union(*(failing for _, failing in MUTANTS[name]))
        assert checks <= caught, (name, checks - caught)
