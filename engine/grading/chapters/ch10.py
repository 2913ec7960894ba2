"""Checks for chapter 10: the top-k router with capacity, the dispatch permutation over real
ranks, the balancing loss; drills on capacity, all-to-all bytes, active parameters, MaxVio,
DeepSeek-V3's size and fine-grained experts. The frontier exercises (dropless dispatch,
aux-loss-free bias) are in :mod:`engine.grading.chapters.ch10_frontier`."""

from __future__ import annotations

import torch

from engine.observe.meter import CommMeter
from engine.grading.core import CheckFailed, Exercise, run_here, run_ranks
from engine.grading.drill import Drill
from engine.labs.moe import zipf_logits
from engine.moe.router import load_balancing_loss, route

# -- ch10.router ----------------------------------------------------------------------------

PRIORITY = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 1.0], [3.0, 0.0]])  # see the notebook
HIDDEN_ROUTES = [  # (logits, top_k, capacity_factor)
    (PRIORITY, 2, 0.5),
    (zipf_logits(12, 4, 0.0, seed=1), 1, 1.0),
    (zipf_logits(16, 8, 0.0, seed=2), 2, 1.25),
    (zipf_logits(32, 8, 1.5, seed=3), 2, 0.5),
    (zipf_logits(24, 6, 0.5, seed=4), 3, 0.25),
    (zipf_logits(20, 5, 1.0, seed=5), 2, 4.0),
    (zipf_logits(64, 8, 2.0, seed=6), 1, 1.0),
]


def _routes(impl):
    for logits, k, cf in HIDDEN_ROUTES:
        got = impl(logits.clone(), k, cf)
        if not (isinstance(got, tuple) and len(got) == 3):
            raise CheckFailed("return a tuple (expert, gate, keep)", top_k=k,
                              capacity_factor=cf)
        expert, gate, keep = (torch.as_tensor(t) for t in got)
        shape = (logits.shape[0], k)
        for name, t in (("expert", expert), ("gate", gate), ("keep", keep)):
            if tuple(t.shape) != shape:
                raise CheckFailed(f"{name} has shape {tuple(t.shape)}, expected {shape} "
                                  "(tokens x top_k)", top_k=k, capacity_factor=cf)
        yield logits, k, cf, expert, gate, keep.bool(), route(logits, k, cf)


def check_top_k_and_gates(impl):
    for logits, k, cf, expert, gate, _, right in _routes(impl):
        inputs = dict(tokens=logits.shape[0], experts=logits.shape[1], top_k=k)
        if not torch.equal(expert.long(), right.expert):
            raise CheckFailed("the experts differ: each row should hold the top_k experts of "
                              "highest probability, most probable first", **inputs)
        if not torch.allclose(gate.float(), right.gate, atol=1e-6):
            what = ("the probability itself" if k == 1 else
                    "the top-k probabilities divided by their sum")
            raise CheckFailed(f"the gates differ: with top_k = {k} a gate is {what}", **inputs)


def check_capacity_and_drop_mask(impl):
    for logits, k, cf, expert, _, keep, right in _routes(impl):
        inputs = dict(tokens=logits.shape[0], experts=logits.shape[1], top_k=k,
                      capacity_factor=cf)
        held = torch.bincount(right.expert[keep], minlength=logits.shape[1])
        if held.max() > right.capacity:
            raise CheckFailed(f"an expert keeps {held.max()} assignments, more than its "
                              f"capacity ceil(T k cf / E) = {right.capacity}", **inputs)
        if not torch.equal(keep, right.keep):
            raise CheckFailed(f"the drop mask differs ({int((~keep).sum())} dropped, expected "
                              f"{right.dropped}): slots go to every first choice in token "
                              "order, then every second choice, ...", **inputs)


# -- ch10.dispatch --------------------------------------------------------------------------

EXPERTS, HIDDEN = 8, 4


def _rows_of(rank: int):
    """Every rank's rows and experts, made in the grader and sent to the ranks (expert 5 never
    chosen)."""
    g = torch.Generator().manual_seed(100 + rank)
    count = 5 + 3 * rank
    rows = torch.randn(count, HIDDEN, generator=g)
    expert = torch.randint(0, EXPERTS, (count,), generator=g)
    expert[expert == 5] = 6
    return rows, expert


def _local_experts(rank: int, world_size: int) -> range:
    local = EXPERTS // world_size
    return range(rank * local, (rank + 1) * local)


def _arriving(everyone, rank: int, world_size: int) -> list[torch.Tensor]:
    """What each of ``rank``'s experts should receive: its rows from every rank, rank 0's
    first, each rank's in their original order (computed in the grader)."""
    return [torch.cat([rows[expert == e] for rows, expert in everyone])
            for e in _local_experts(rank, world_size)]


def _combine_scale(everyone, rank: int, world_size: int) -> torch.Tensor:
    """What ``rank``'s experts "compute": each expert's rows times (its id + 1), so that every
    row comes home scaled by its own expert's factor."""
    return torch.cat([torch.full((len(x), 1), e + 1.0) for x, e in
                      zip(_arriving(everyone, rank, world_size),
                          _local_experts(rank, world_size))])


def _upstream(rows: torch.Tensor) -> torch.Tensor:
    return torch.randn(rows.shape, generator=torch.Generator().manual_seed(7))


def _dispatch_on_rank(rank, world_size, module, everyone, scales, upstreams):
    """A driver (runs where the learner's code does): dispatch this rank's rows, combine them
    scaled, backward. It returns what it saw: the rows received, the counts, the rows brought
    home, the tokens' gradient and the meter's events; the check compares them in the
    grader."""
    rows, expert = everyone[rank]
    tokens = rows.clone().requires_grad_()
    with CommMeter(count="wire") as out:
        received, counts, state = module.dispatch(tokens, expert, EXPERTS)
    with CommMeter(count="wire") as back:
        home = module.combine(received * scales[rank], state)
    with CommMeter(count="wire") as backward:
        (home * upstreams[rank]).sum().backward()
    return dict(received=received.detach().clone(), counts=list(counts),
                home=home.detach().clone(),
                grad=None if tokens.grad is None else tokens.grad.detach().clone(),
                ops={name: [(e.op, e.dtype.removeprefix("torch."), e.bytes_sent)
                            for e in meter.events]
                     for name, meter in (("dispatch", out), ("combine", back),
                                         ("backward", backward))})


def _same(got, want: torch.Tensor) -> bool:
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(
        got, want, atol=1e-6)


def _judged(seen: dict, everyone, rank: int, world_size: int) -> dict:
    """What one rank saw, against what it should have (both here, in the grader)."""
    expected = _arriving(everyone, rank, world_size)
    rows, expert = everyone[rank]
    factor = (expert + 1.0)[:, None]
    mine = _local_experts(rank, world_size)
    kept_here = int(((expert >= mine.start) & (expert < mine.stop)).sum())
    row_bytes = HIDDEN * 4  # only rows that change rank cross the wire
    arriving = sum(len(x) for x in expected)
    return dict(received=torch.equal(seen["received"], torch.cat(expected)),
                counts=list(seen["counts"]) == [len(x) for x in expected],
                home=_same(seen["home"], rows * factor),
                grad=_same(seen["grad"], _upstream(rows) * factor),
                expected_bytes=((len(expert) - kept_here) * row_bytes,
                                (arriving - kept_here) * row_bytes),
                ops=seen["ops"])


def _dispatch_results(module):
    for world_size in (2, 4):
        everyone = [_rows_of(r) for r in range(world_size)]
        scales = [_combine_scale(everyone, r, world_size) for r in range(world_size)]
        upstreams = [_upstream(rows) for rows, _ in everyone]
        for rank, seen in enumerate(run_ranks(_dispatch_on_rank, world_size, module, everyone,
                                              scales, upstreams, timeout=30)):
            yield world_size, rank, _judged(seen, everyone, rank, world_size)


def check_experts_receive_their_rows(module):
    for world_size, rank, result in _dispatch_results(module):
        if not result["counts"]:
            raise CheckFailed(f"rank {rank}: the block sizes (counts) dispatch returned are "
                              "wrong: one per local expert, the rows it receives from every "
                              "rank", world_size=world_size)
        if not result["received"]:
            raise CheckFailed(f"rank {rank}: dispatch gave its experts the wrong rows: each "
                              "local expert's rows together, those of rank 0 first, each "
                              "rank's in their original order (sort stably by expert, then "
                              "regroup what arrives by expert, then source rank)",
                              world_size=world_size)


def check_combine_returns_every_row_home(module):
    for world_size, rank, result in _dispatch_results(module):
        if not result["home"]:
            raise CheckFailed(f"rank {rank}: combine did not bring every row back in the order "
                              "of the original tokens (undo the regrouping, all-to-all with "
                              "the splits swapped, undo the sort)", world_size=world_size)
        if not result["grad"]:
            raise CheckFailed(f"rank {rank}: the gradient that reached the tokens is wrong: "
                              "move rows with the differentiable all_to_all, and index "
                              "instead of copying into preallocated buffers",
                              world_size=world_size)


def check_one_all_to_all_each_way(module):
    for world_size, rank, result in _dispatch_results(module):
        ops = result["ops"]
        rows_out = [e for e in ops["dispatch"] if e[1] != "int64"]
        extra = [e for e in ops["dispatch"] if e[1] == "int64"]
        shape = dict(world_size=world_size, dispatch=ops["dispatch"], combine=ops["combine"],
                     backward=ops["backward"])
        if [e[0] for e in rows_out] != ["all_to_all"] or [e[0] for e in extra] not in (
                [], ["all_to_all"]):
            raise CheckFailed(f"rank {rank}: dispatch must be one all-to-all of the rows "
                              "(after at most one all-to-all of the int64 counts), through "
                              "engine.comm.ops; the meter saw something else", **shape)
        if [e[0] for e in ops["combine"]] != ["all_to_all"]:
            raise CheckFailed(f"rank {rank}: combine must be exactly one all-to-all", **shape)
        if [e[0] for e in ops["backward"]] != ["all_to_all", "all_to_all"]:
            raise CheckFailed(f"rank {rank}: backward must be the two all-to-alls reversed, "
                              "nothing else", **shape)
        sent_out, sent_back = result["expected_bytes"]
        if rows_out[0][2] != sent_out or ops["combine"][0][2] != sent_back:
            raise CheckFailed(f"rank {rank}: the all-to-alls sent {rows_out[0][2]} and "
                              f"{ops['combine'][0][2]} bytes; exactly the rows that change rank "
                              f"make {sent_out} and {sent_back} (no padding, no extra rows)",
                              **shape)


# -- ch10.balancing_loss --------------------------------------------------------------------

HIDDEN_LOSSES = [(32, 4, 1, 0.01), (48, 8, 2, 0.01), (40, 8, 2, 0.1), (30, 6, 3, 1.0)]


def _loss_on(impl, probs, expert, alpha, gradient):
    """A driver (runs where the learner's code does): the loss on ``probs`` (requiring a
    gradient) and, with ``gradient``, its gradient with respect to them. It returns what it
    saw; the check compares it in the grader with the engine's loss."""
    probs = probs.clone().requires_grad_()
    got = impl(probs, expert, alpha)
    if not isinstance(got, torch.Tensor):
        return dict(tensor=False)
    seen = dict(tensor=True, numel=got.numel(), value=got.detach().clone(),
                requires_grad=got.requires_grad, grad=None)
    if gradient and got.requires_grad and got.numel() == 1:
        seen["grad"], = torch.autograd.grad(got, probs)
    return seen


def _loss_cases(impl, gradient=False):
    for tokens, experts, k, alpha in HIDDEN_LOSSES:
        logits = zipf_logits(tokens, experts, 1.0, seed=tokens)
        probs = logits.softmax(-1).requires_grad_()
        expert = probs.detach().topk(k).indices
        seen = run_here(_loss_on, impl, probs.detach(), expert.clone(), alpha, gradient)
        if not seen["tensor"] or seen["numel"] != 1:
            raise CheckFailed("return a one-element tensor", tokens=tokens, experts=experts)
        yield (dict(tokens=tokens, experts=experts, top_k=k, alpha=alpha), probs, expert,
               seen, load_balancing_loss(probs, expert, alpha))


def check_value(impl):
    balanced = impl(torch.full((8, 4), 0.25), torch.arange(8).remainder(4)[:, None], 0.01)
    if abs(balanced.item() - 0.01) > 1e-7:
        raise CheckFailed(f"perfectly balanced routing gives {balanced.item():.6f}, expected "
                          "alpha = 0.01: " + _what_the_factor_says(
                              balanced.item() / 0.01, dict(tokens=8, experts=4, top_k=1)))
    for inputs, _, _, seen, right in _loss_cases(impl):
        got, right = seen["value"].item(), right.item()
        if abs(got - right) > 1e-6 * max(1.0, abs(right)):
            raise CheckFailed(f"got {got:.6f}, expected {right:.6f}: "
                              + _what_the_factor_says(got / right, inputs), **inputs)


def _what_the_factor_says(ratio: float, inputs: dict) -> str:
    """The mistake a loss ``ratio`` times the right one shows, named only when it is that."""
    k, tokens, experts = inputs["top_k"], inputs["tokens"], inputs["experts"]
    known = {k: f"f_i divides by T = {tokens} only: it counts the T*k assignments, so divide "
                "by T*k",
             1 / experts: "the factor E (the number of experts) is missing",
             float(tokens): f"P_i sums probs over the T = {tokens} tokens: it is their mean"}
    for factor, mistake in known.items():
        if factor != 1 and abs(ratio - factor) < 1e-4 * factor:
            return f"{ratio:.4g} times the right value: {mistake}"
    return ("f_i counts the T*k assignments (divide by T*k), P_i averages probs over tokens, "
            "times alpha and E")


def check_gradient_only_through_p(impl):
    for inputs, probs, _, seen, right in _loss_cases(impl, gradient=True):
        if not seen["requires_grad"]:
            raise CheckFailed("the loss has no gradient: P_i must come from probs", **inputs)
        mine = seen["grad"]
        expected, = torch.autograd.grad(right, probs)
        if not torch.allclose(mine, expected, atol=1e-7):
            raise CheckFailed("the gradient with respect to probs is wrong: "
                              + _what_the_gradient_says(mine, expected, inputs), **inputs)


def _what_the_gradient_says(mine, expected, inputs: dict) -> str:
    """The right gradient, alpha E f_i / T, is the same for every token of an expert: one that
    varies by token has a gradient through f_i (or elsewhere); one off by a constant factor
    shares the value's mistake."""
    if not torch.allclose(mine, mine[:1].expand_as(mine), atol=1e-7):
        return ("it differs from token to token, so something besides P_i carries a gradient: "
                "f_i is a count (bincount, no gradient); only P_i = probs.mean(0) carries one")
    ratio = (mine[0] / expected[0])[expected[0] != 0]
    if ratio.numel() and torch.allclose(ratio, ratio[:1].expand_as(ratio), rtol=1e-4):
        return (f"{ratio[0].item():.4g} times the right one, the same for every expert: the "
                "value is off by that factor too (see check value)")
    return ("d loss / d probs[t, i] must be alpha * E * f_i / T for every token t: the weight "
            "of expert i is its share f_i of the T*k assignments")


EXERCISES = [
    Exercise(
        name="ch10.router",
        title="The top-k router with capacity and its drop mask",
        module="ch10_router",
        attr="top_k_route",
        checks=(check_top_k_and_gates, check_capacity_and_drop_mask),
        hints=(
            "Each token picks its top_k experts by probability; each expert has room for "
            "capacity = ceil(T k cf / E) assignments, handed out in priority order: every first "
            "choice in token order, then every second choice, and so on.",
            "logits.softmax(-1).topk(top_k, dim=-1) gives (probabilities, experts); divide by "
            "their sum when top_k > 1; math.ceil for the capacity; a per-expert counter "
            "(torch.zeros(E, dtype=torch.long)) tracks the slots taken.",
            "probs = logits.softmax(-1); top, expert = probs.topk(k); gate = top / top.sum(-1, "
            "keepdim=True) if k > 1 else top; taken = zeros(E); keep = zeros(T, k, bool); for j "
            "in range(k): for t in range(T): if taken[expert[t, j]] < capacity: keep[t, j] = "
            "True; taken[expert[t, j]] += 1.",
        ),
        blocks=("engine.moe.router.route",),
    ),
    Exercise(
        name="ch10.dispatch",
        title="The dispatch permutation: tokens to their experts' ranks and back",
        module="ch10_dispatch",
        attr="",
        checks=(check_experts_receive_their_rows, check_combine_returns_every_row_home,
                check_one_all_to_all_each_way),
        hints=(
            "Sort your rows by expert, which groups them by destination rank; tell every rank "
            "how many rows it will receive; send them in one all-to-all; regroup what arrives "
            "by local expert. combine undoes each step in reverse order.",
            "torch.argsort(expert, stable=True); torch.bincount(expert, minlength=E); "
            "ops.all_to_all_single(out, counts, group=group) exchanges the counts; "
            "all_to_all(rows, output_splits, input_splits, group) moves rows differentiably; "
            "index_copy undoes a permutation.",
            "order = argsort(expert, stable=True); counts = bincount; incoming = the exchanged "
            "counts, viewed [n, E/n]; arrived = all_to_all(tokens[order], incoming.sum(1), "
            "counts.view(n, -1).sum(1)); regroup = stable argsort of the block ids (local "
            "expert * n + source) repeated by incoming; return arrived[regroup], "
            "incoming.sum(0), state. combine: undo regroup, all_to_all with the splits swapped, "
            "undo the sort.",
        ),
        blocks=("engine.moe.dispatch.dispatch", "engine.moe.dispatch.combine"),
    ),
    Exercise(
        name="ch10.balancing_loss",
        title="Switch Transformers' load-balancing loss",
        module="ch10_balancing_loss",
        attr="load_balancing_loss",
        checks=(check_value, check_gradient_only_through_p),
        hints=(
            "The loss is large when the experts that get many tokens are also those the router "
            "gives much probability: the product of how often an expert is chosen (a count) and "
            "its mean probability (differentiable), summed over experts.",
            "torch.bincount(expert.flatten(), minlength=E) counts the assignments; "
            "probs.mean(dim=0) is P; a count carries no gradient, so only P does.",
            "f = bincount(expert.flatten(), minlength=E) / expert.numel(); P = probs.mean(0); "
            "return alpha * E * (f * P).sum().",
        ),
        blocks=("engine.moe.router.load_balancing_loss",),
    ),
]

DRILLS = [  # questions from engine.drill's bank: the answers are computed, not typed
    Drill("ch10.capacity", "moe-capacity"),
    Drill("ch10.dispatch_megabytes", "moe-all-to-all-bytes"),
    Drill("ch10.active_params", "moe-active-params"),
    Drill("ch10.max_violation", "moe-max-violation"),
    Drill("ch10.deepseek_active", "moe-deepseek-active"),
    Drill("ch10.fine_grained", "moe-fine-grained-combinations"),
    Drill("ch10.all_to_all_over_infiniband", "moe-a2a-over-infiniband"),
]
