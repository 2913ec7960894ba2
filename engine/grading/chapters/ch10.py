"""Checks for chapter 10: the top-k router with capacity, the dispatch permutation over real
ranks, the balancing loss; drills on capacity, all-to-all bytes and active parameters."""

from __future__ import annotations

import torch

from engine import theory
from engine.comm import CommMeter
from engine.grading.core import CheckFailed, Exercise, run_ranks
from engine.grading.drill import Drill
from engine.moe.experiments import zipf_logits
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
    """Every rank's rows and experts, known to all ranks (expert 5 never chosen)."""
    g = torch.Generator().manual_seed(100 + rank)
    count = 5 + 3 * rank
    rows = torch.randn(count, HIDDEN, generator=g)
    expert = torch.randint(0, EXPERTS, (count,), generator=g)
    expert[expert == 5] = 6
    return rows, expert


def _dispatch_on_rank(rank, world_size, module):
    local = EXPERTS // world_size
    mine = range(rank * local, (rank + 1) * local)
    everyone = [_rows_of(r) for r in range(world_size)]
    expected = [torch.cat([rows[expert == e] for rows, expert in everyone]) for e in mine]
    rows, expert = everyone[rank]
    tokens = rows.clone().requires_grad_()
    with CommMeter(count="wire") as out:
        received, counts, state = module.dispatch(tokens, expert, EXPERTS)
    result = dict(received=torch.equal(received.detach(), torch.cat(expected)),
                  counts=list(counts) == [len(x) for x in expected])
    scale = torch.cat([torch.full((len(x), 1), e + 1.0) for x, e in zip(expected, mine)])
    with CommMeter(count="wire") as back:
        home = module.combine(received * scale, state)
    upstream = torch.randn(rows.shape, generator=torch.Generator().manual_seed(7))
    with CommMeter(count="wire") as backward:
        (home * upstream).sum().backward()
    factor = (expert + 1.0)[:, None]
    result["home"] = torch.allclose(home.detach(), rows * factor, atol=1e-6)
    result["grad"] = tokens.grad is not None and torch.allclose(tokens.grad, upstream * factor,
                                                                atol=1e-6)
    kept_here = int(((expert >= rank * local) & (expert < (rank + 1) * local)).sum())
    row_bytes = HIDDEN * 4  # only rows that change rank cross the wire
    result["expected_bytes"] = ((len(expert) - kept_here) * row_bytes,
                                (len(scale) - kept_here) * row_bytes)
    result["ops"] = {name: [(e.op, e.dtype.removeprefix("torch."), e.bytes_sent)
                            for e in meter.events]
                     for name, meter in (("dispatch", out), ("combine", back),
                                         ("backward", backward))}
    return result


def _dispatch_results(module):
    for world_size in (2, 4):
        for rank, result in enumerate(run_ranks(_dispatch_on_rank, world_size, module,
                                                timeout=30)):
            yield world_size, rank, result


def check_experts_receive_their_rows(module):
    for world_size, rank, result in _dispatch_results(module):
        if not result["counts"]:
            raise CheckFailed(f"rank {rank}: the block sizes (counts) are wrong: one per local "
                              "expert, the rows it receives from every rank",
                              world_size=world_size)
        if not result["received"]:
            raise CheckFailed(f"rank {rank}: its experts got the wrong rows: each local expert's "
                              "rows together, those of rank 0 first, each rank's in their "
                              "original order (sort stably by expert, then regroup what "
                              "arrives by expert, then source rank)", world_size=world_size)


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


def _loss_cases(impl):
    for tokens, experts, k, alpha in HIDDEN_LOSSES:
        logits = zipf_logits(tokens, experts, 1.0, seed=tokens)
        probs = logits.softmax(-1).requires_grad_()
        expert = probs.detach().topk(k).indices
        got = impl(probs, expert, alpha)
        if not isinstance(got, torch.Tensor) or got.numel() != 1:
            raise CheckFailed("return a one-element tensor", tokens=tokens, experts=experts)
        yield (dict(tokens=tokens, experts=experts, top_k=k, alpha=alpha), probs, expert,
               got, load_balancing_loss(probs, expert, alpha))


def check_value(impl):
    balanced = impl(torch.full((8, 4), 0.25), torch.arange(8).remainder(4)[:, None], 0.01)
    if abs(balanced.item() - 0.01) > 1e-7:
        raise CheckFailed(f"perfectly balanced routing gives {balanced.item():.6f}, expected "
                          "alpha = 0.01")
    for inputs, _, _, got, right in _loss_cases(impl):
        got, right = got.detach().item(), right.item()
        if abs(got - right) > 1e-6 * max(1.0, abs(right)):
            raise CheckFailed(f"got {got:.6f}, expected {right:.6f}: f_i counts "
                              "the T*k assignments (divide by T*k), P_i averages probs over "
                              "tokens, times alpha and E", **inputs)


def check_gradient_only_through_p(impl):
    for inputs, probs, expert, got, right in _loss_cases(impl):
        if not got.requires_grad:
            raise CheckFailed("the loss has no gradient: P_i must come from probs", **inputs)
        mine, = torch.autograd.grad(got, probs)
        expected, = torch.autograd.grad(right, probs)
        if not torch.allclose(mine, expected, atol=1e-7):
            raise CheckFailed("the gradient with respect to probs is wrong: f_i is a count, "
                              "with no gradient; only P_i carries one", **inputs)


EXERCISES = [
    Exercise(
        name="ch10.router",
        title="The top-k router with capacity and its drop mask",
        module="ch10_router",
        attr="top_k_route",
        checks=(check_top_k_and_gates, check_capacity_and_drop_mask),
        hint="probs = logits.softmax(-1); top, expert = probs.topk(k); gate = top / top.sum(-1, "
             "keepdim=True) when k > 1. Then for j in range(k): for t in range(T): keep[t, j] "
             "if the expert's count < capacity (and count it).",
    ),
    Exercise(
        name="ch10.dispatch",
        title="The dispatch permutation: tokens to their experts' ranks and back",
        module="ch10_dispatch",
        attr="",
        checks=(check_experts_receive_their_rows, check_combine_returns_every_row_home,
                check_one_all_to_all_each_way),
        hint="order = argsort(expert, stable=True); counts = bincount; one all-to-all of the "
             "counts gives incoming [n, E/n]; all_to_all(tokens[order], incoming.sum(1), "
             "counts.view(n, -1).sum(1)); regroup by (local expert, source) with a stable "
             "argsort of the block ids. combine: invert both permutations around the reverse "
             "all-to-all.",
    ),
    Exercise(
        name="ch10.balancing_loss",
        title="Switch Transformers' load-balancing loss",
        module="ch10_balancing_loss",
        attr="load_balancing_loss",
        checks=(check_value, check_gradient_only_through_p),
        hint="f = bincount(expert.flatten(), minlength=E) / expert.numel(); P = probs.mean(0); "
             "return alpha * E * (f * P).sum().",
    ),
]

DRILLS = [
    Drill("ch10.capacity",
          "4096 tokens per GPU, 64 experts, top-2 routing, capacity factor 1.25: how many "
          "token slots does each expert get?", theory.expert_capacity(4096, 64, 2, 1.25),
          "ceil(T k cf / E) = ceil(4096 x 2 x 1.25 / 64) = 160."),
    Drill("ch10.dispatch_megabytes",
          "8-way expert parallelism, 4096 tokens per GPU, hidden 4096, top-2, bf16: how many "
          "MB (10^6 bytes) does each GPU send in one dispatch all-to-all?",
          theory.moe_all_to_all_bytes(4096, 4096, 2, 8, 2)["dispatch"] / 1e6,
          "(n-1)/n x T k h x 2 bytes = 7/8 x 4096 x 2 x 4096 x 2 = 58.7 MB; a layer does four "
          "of them (dispatch and combine, forward and backward)."),
    Drill("ch10.mixtral_active",
          "Mixtral-8x7B (8 experts, top-2) has about 46.7 billion parameters. About how many "
          "billion does one token use?",
          round(theory.moe_params(32, 4096, 14336, 8, 2, 32000, kv_hidden=1024)["active"] / 1e9,
                1),
          "Attention, norms, routers and embeddings are shared; of each layer's 8 experts a "
          "token uses 2: about 12.9 B, not 2 x 7 = 14 B or 46.7 B.", rel_tol=0.02),
]
