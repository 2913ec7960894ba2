"""Checks for chapter 10's frontier exercises: the dropless dispatch over real ranks (uneven
splits, no capacity, each expert once on its whole batch) and DeepSeek-V3's aux-loss-free bias
(the biased choice with unbiased gates, the sign update)."""

from __future__ import annotations

import torch
from torch import nn

from engine.observe.meter import CommMeter
from engine.grading.core import CheckFailed, Exercise, run_here, run_ranks
from engine.moe.balance import biased_top_k, update_bias
from engine.labs.moe import zipf_logits
from engine.moe.layer import Expert

# -- ch10.dropless_dispatch -------------------------------------------------------------------

EXPERTS, HIDDEN, TOP_K = 8, 4, 2


def _assignments(rank: int):
    """Every rank's tokens, experts and gates, known to all ranks: expert 0 takes about half of
    the assignments (capacity 1.25 would drop some), experts 5 and 6 none."""
    g = torch.Generator().manual_seed(200 + rank)
    tokens = 6 + 3 * rank
    x = torch.randn(tokens, HIDDEN, generator=g)
    first = torch.where(torch.rand(tokens, generator=g) < 0.8, 0,
                        torch.randint(1, EXPERTS, (tokens,), generator=g))
    second = torch.randint(1, EXPERTS, (tokens,), generator=g)
    second = torch.where(second == first, (second % (EXPERTS - 1)) + 1, second)
    expert = torch.stack([first, second], dim=1)
    expert[(expert == 5) | (expert == 6)] = 7
    gate = torch.rand(tokens, TOP_K, generator=g).softmax(-1)
    return x, expert, gate


class _Recorded(nn.Module):
    """An expert that notes the size of every batch it is called on."""

    def __init__(self, expert: nn.Module):
        super().__init__()
        self.expert, self.calls = expert, []

    def forward(self, rows):
        self.calls.append(int(rows.shape[0]))
        return self.expert(rows)


def _all_experts():
    experts = []
    for e in range(EXPERTS):
        torch.manual_seed(300 + e)
        experts.append(Expert(HIDDEN, 2 * HIDDEN))
    return experts


def _dropless_on_rank(rank, world_size, module, everyone, upstream):
    """A driver (runs where the learner's code does): the learner's dropless layer on this
    rank's tokens, with recorded experts, then backward. It returns what it saw: the output,
    the gradients of x, the gates and the local experts' parameters, the batches each expert
    ran on and the meter's events; the check compares them in the grader with one process
    computing every assignment."""
    local = EXPERTS // world_size
    mine = list(range(rank * local, (rank + 1) * local))
    x, expert, gate = everyone[rank]
    x, gate = x.clone().requires_grad_(), gate.clone().requires_grad_()
    experts = [_Recorded(_all_experts()[e]) for e in mine]
    with CommMeter(count="wire") as forward:
        out = module.dropless_moe(x, expert, gate, experts, EXPERTS)
    with CommMeter(count="wire") as backward:
        (out * upstream[rank]).sum().backward()
    return dict(
        output=out.detach().clone(),
        x_grad=None if x.grad is None else x.grad.clone(),
        gate_grad=None if gate.grad is None else gate.grad.clone(),
        expert_grads={e: {name: None if p.grad is None else p.grad.clone()
                          for name, p in rec.expert.named_parameters()}
                      for e, rec in zip(mine, experts)},
        calls={e: [c for c in rec.calls if c] for e, rec in zip(mine, experts)},
        ops={name: [(ev.op, ev.dtype.removeprefix("torch."), ev.bytes_sent)
                    for ev in meter.events]
             for name, meter in (("forward", forward), ("backward", backward))})


def _dropless_inputs(world_size: int):
    """Every rank's tokens, experts and gates, and the gradient each rank's output gets."""
    everyone = [_assignments(r) for r in range(world_size)]
    upstream = [torch.randn(len(a[0]), HIDDEN, generator=torch.Generator().manual_seed(9 + r))
                for r, a in enumerate(everyone)]
    return everyone, upstream


def _one_process(everyone, upstream) -> dict:
    """The reference, computed in the grader: one process, every rank's tokens, every
    assignment; each rank's output and the gradients of its x and gates, and every expert's
    parameter gradients."""
    with torch.random.fork_rng(devices=[]):  # _all_experts seeds: leave the grader's RNG
        reference = _all_experts()
    outs, x_grads, gate_grads = [], [], []
    for r, (x, expert, gate) in enumerate(everyone):
        x, gate = x.clone().requires_grad_(), gate.clone().requires_grad_()
        out = sum(gate[:, j:j + 1] * torch.stack([reference[int(e)](x[t]) for t, e in
                                                   enumerate(expert[:, j])])
                  for j in range(TOP_K))
        (out * upstream[r]).sum().backward()
        outs.append(out.detach())
        x_grads.append(x.grad)
        gate_grads.append(gate.grad)
    return dict(output=outs, x_grad=x_grads, gate_grad=gate_grads,
                expert_grads=[{name: _grad(p) for name, p in e.named_parameters()}
                              for e in reference])


def _judged(seen: dict, reference: dict, everyone, rank: int, world_size: int) -> dict:
    """What one rank saw, against one process's answer (here, in the grader)."""
    local = EXPERTS // world_size
    mine = list(range(rank * local, (rank + 1) * local))
    x, expert, _ = everyone[rank]
    out, want = seen["output"], reference["output"][rank]
    expert_err = max(_err(_or_zeros(seen["expert_grads"][e][name], want_grad), want_grad)
                     for e in mine for name, want_grad in reference["expert_grads"][e].items())
    rows_for = {e: sum(int((a[1] == e).sum()) for a in everyone) for e in mine}
    here = (expert >= rank * local) & (expert < (rank + 1) * local)
    leaving = int((~here).sum())
    arriving = sum(rows_for.values()) - int(here.sum())
    return dict(
        shape_ok=tuple(out.shape) == tuple(x.shape),
        output=(out - want).abs().max().item() if out.shape == x.shape else float("inf"),
        x_grad=_err(seen["x_grad"], reference["x_grad"][rank]),
        gate_grad=_err(seen["gate_grad"], reference["gate_grad"][rank]),
        expert_grads=expert_err, calls=seen["calls"], rows_for=rows_for,
        row_bytes=(leaving * HIDDEN * 4, arriving * HIDDEN * 4), ops=seen["ops"])


def _grad(p: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient, zeros where no row reached it."""
    return torch.zeros_like(p) if p.grad is None else p.grad


def _or_zeros(grad, like: torch.Tensor) -> torch.Tensor:
    """A gradient the driver saw, zeros where no row reached its parameter."""
    return torch.zeros_like(like) if grad is None else grad


def _err(got, want) -> float:
    return float("inf") if got is None else (got - want).abs().max().item()


_RESULTS: dict = {}  # "impl": the graded impl, "runs": {world size: results}


def _dropless_results(module):
    """Each world size's per-rank results, run once per graded impl (the checks share them)."""
    if _RESULTS.get("impl") is not module:
        _RESULTS.clear()
        _RESULTS.update(impl=module, runs={})
    runs = _RESULTS["runs"]
    for world_size in (2, 4):
        if world_size not in runs:
            everyone, upstream = _dropless_inputs(world_size)
            seen = run_ranks(_dropless_on_rank, world_size, module, everyone, upstream,
                             timeout=30)
            reference = _one_process(everyone, upstream)
            runs[world_size] = [_judged(s, reference, everyone, rank, world_size)
                                for rank, s in enumerate(seen)]
        for rank, result in enumerate(runs[world_size]):
            yield world_size, rank, result


def check_every_assignment_computed(module):
    for world_size, rank, r in _dropless_results(module):
        where = dict(world_size=world_size, rank=rank)
        if not r["shape_ok"]:
            raise CheckFailed("return one row per token, [T, h], as x", **where)
        if r["output"] > 1e-5:
            raise CheckFailed(f"the output differs from every assignment computed (by up to "
                              f"{r['output']:.3g}): with no capacity nothing is dropped, and "
                              "each token's k expert outputs are weighted by its gates and "
                              "added", **where)
        if max(r["x_grad"], r["gate_grad"]) > 1e-5:
            raise CheckFailed("the gradients of x or of the gates are wrong: move the rows "
                              "with the differentiable all_to_all and weight them by gate "
                              "after they come back", **where)
        if r["expert_grads"] > 1e-5:
            raise CheckFailed("an expert's weight gradient is wrong: it must sum the rows of "
                              "every rank that chose it", **where)


def check_each_expert_once_on_its_whole_batch(module):
    for world_size, rank, r in _dropless_results(module):
        for e, calls in r["calls"].items():
            want = r["rows_for"][e]
            if calls != ([want] if want else []):
                raise CheckFailed(f"rank {rank}: expert {e} ran on batches of {calls} rows; "
                                  f"it should run once on all its {want} rows from every rank "
                                  "(regroup what arrives by expert, then source rank)",
                                  world_size=world_size, expert=e)


def check_uneven_all_to_all_without_padding(module):
    for world_size, rank, r in _dropless_results(module):
        ops = r["ops"]
        rows = [e for e in ops["forward"] if e[1] != "int64"]
        counts = [e for e in ops["forward"] if e[1] == "int64"]
        shape = dict(world_size=world_size, forward=ops["forward"], backward=ops["backward"])
        if [e[0] for e in rows] != ["all_to_all", "all_to_all"] or len(counts) > 1:
            raise CheckFailed(f"rank {rank}: forward must be one all-to-all of rows out and "
                              "one back (after at most one all-to-all of int64 counts), "
                              "through engine.comm.ops", **shape)
        if [e[0] for e in ops["backward"]] != ["all_to_all", "all_to_all"]:
            raise CheckFailed(f"rank {rank}: backward must be the two all-to-alls reversed",
                              **shape)
        out, back = r["row_bytes"]
        if (rows[0][2], rows[1][2]) != (out, back):
            raise CheckFailed(f"rank {rank}: the all-to-alls sent {rows[0][2]} and "
                              f"{rows[1][2]} bytes; exactly the assignment rows that change "
                              f"rank make {out} and {back}: uneven splits, no padding to a "
                              "capacity", **shape)


# -- ch10.aux_free_bias -----------------------------------------------------------------------

def _bias_cases():
    """(probs, bias, top_k): the bias changes some choices in each."""
    for tokens, experts, k, skew, seed in ((16, 4, 1, 1.0, 1), (24, 8, 2, 1.5, 2),
                                           (12, 6, 3, 0.5, 3)):
        probs = zipf_logits(tokens, experts, skew, seed=seed).softmax(-1)
        bias = torch.linspace(-0.15, 0.15, experts)[torch.randperm(
            experts, generator=torch.Generator().manual_seed(seed))]
        yield probs, bias, k


def check_the_bias_chooses(module):
    for probs, bias, k in _bias_cases():
        inputs = dict(tokens=probs.shape[0], experts=probs.shape[1], top_k=k)
        expert, _ = module.biased_top_k(probs.clone(), bias.clone(), k)
        right, _ = biased_top_k(probs, bias, k)
        if torch.equal(torch.as_tensor(expert).long(), probs.topk(k).indices):
            raise CheckFailed("the experts are the top-k of probs alone: add the bias to the "
                              "scores before choosing", **inputs)
        if not torch.equal(torch.as_tensor(expert).long(), right):
            raise CheckFailed("the experts differ from the top-k of probs + bias, most "
                              "preferred first", **inputs)


def _gates_on(module, probs, bias, k, upstream):
    """A driver (runs where the learner's code does): biased_top_k on ``probs`` requiring a
    gradient, and the gradient of (gate * upstream).sum() with respect to them. It returns
    what it saw (the gradient, or why autograd could not give one); the check compares it in
    the grader."""
    probs = probs.clone().requires_grad_()
    expert, gate = module.biased_top_k(probs, bias, k)
    seen = dict(expert=expert, gate=gate.detach().clone() if isinstance(gate, torch.Tensor)
                else None, requires_grad=isinstance(gate, torch.Tensor) and gate.requires_grad,
                grad=None, grad_error=None)
    if seen["requires_grad"] and gate.shape == upstream.shape:
        try:
            seen["grad"], = torch.autograd.grad((gate * upstream).sum(), probs)
        except RuntimeError as e:  # raised in the check, where it was raised before
            seen["grad_error"] = str(e)
    return seen


def check_the_gates_are_unbiased(module):
    for probs, bias, k in _bias_cases():
        inputs = dict(tokens=probs.shape[0], experts=probs.shape[1], top_k=k)
        shape = (probs.shape[0], k)
        upstream = torch.randn(shape, generator=torch.Generator().manual_seed(5))
        seen = run_here(_gates_on, module, probs.clone(), bias.clone(), k, upstream.clone())
        gate = seen["gate"]
        if gate is None or tuple(gate.shape) != shape \
                or tuple(torch.as_tensor(seen["expert"]).shape) != shape:
            raise CheckFailed(f"return experts and gates of shape {shape}", **inputs)
        probs = probs.clone().requires_grad_()
        top = probs.gather(-1, torch.as_tensor(seen["expert"]).long())  # *your* experts' gates
        right = top / top.sum(dim=-1, keepdim=True) if k > 1 else top
        if not torch.allclose(gate, right.detach(), atol=1e-6):
            raise CheckFailed("the gates differ: they come from probs without the bias (the "
                              "bias only chooses), renormalised over the k when k > 1",
                              **inputs)
        if not seen["requires_grad"]:
            raise CheckFailed("the gates carry no gradient: gather them from probs",
                              **inputs)
        if seen["grad_error"] is not None:
            raise RuntimeError(seen["grad_error"])
        want, = torch.autograd.grad((right * upstream).sum(), probs)
        if not torch.allclose(seen["grad"], want, atol=1e-6):
            raise CheckFailed("the gradient of the gates with respect to probs is wrong",
                              **inputs)


UPDATES = [  # (bias, load, gamma)
    (torch.zeros(4), torch.tensor([10, 2, 4, 0]), 0.001),  # expert 2 exactly at the mean
    (torch.tensor([0.3, -0.1, 0.0, 0.2, 0.0, 0.05]), torch.tensor([40, 1, 7, 7, 3, 2]), 0.01),
    (torch.tensor([0.01, -0.02]), torch.tensor([3, 5]), 0.5),
]


def check_the_sign_update(module):
    for bias, load, gamma in UPDATES:
        inputs = dict(bias=bias.tolist(), load=load.tolist(), gamma=gamma)
        got = module.update_bias(bias.clone(), load.clone(), gamma)
        right = update_bias(bias, load, gamma)
        if not isinstance(got, torch.Tensor) or got.shape != right.shape:
            raise CheckFailed("return the new biases, a tensor like bias", **inputs)
        if torch.allclose(got, bias - (right - bias), atol=1e-9):
            raise CheckFailed("the biases moved the wrong way: an overloaded expert's bias "
                              "must fall (mean load - load)", **inputs)
        if not torch.allclose(got, right, atol=1e-9):
            raise CheckFailed(f"got {got.tolist()}, expected {right.tolist()}: each bias moves "
                              "by exactly gamma times the sign of (mean load - its load), not "
                              "by the size of the error; 0 for an expert at the mean", **inputs)


EXERCISES = [
    Exercise(
        name="ch10.dropless_dispatch",
        title="Dropless MoE: uneven all-to-alls, each expert on its whole batch",
        module="ch10_dropless_dispatch",
        attr="",
        checks=(check_every_assignment_computed, check_each_expert_once_on_its_whole_batch,
                check_uneven_all_to_all_without_padding),
        hints=(
            "Make one row per (token, expert) assignment, send each to the rank holding its "
            "expert with the counts exchanged first, so no expert has a fixed number of slots; "
            "run each expert once on everything that arrived for it; bring the rows home and "
            "add each token's k rows weighted by its gates.",
            "torch.arange(T).repeat_interleave(k) gives each assignment's token; "
            "torch.bincount(expert.reshape(-1), minlength=E) the counts; "
            "ops.all_to_all_single for the counts; all_to_all(rows, output_splits, "
            "input_splits, group) for the rows; rows.split(sizes) for the experts' blocks; "
            "index_add(0, token, rows * gate) for the sum.",
            "token = arange(T).repeat_interleave(k); flat = expert.reshape(-1); order = "
            "argsort(flat, stable=True); your ch10.dispatch on x[token][order] (counts, "
            "all_to_all, regroup); y = cat([e(b) for e, b in zip(experts, blocks)]); undo the "
            "regroup, all_to_all back, undo the sort; return zeros.index_add(0, token, rows * "
            "gate.reshape(-1, 1)).",
        ),
        blocks=("engine.moe.dropless.dropless_moe", "engine.moe.dropless.mix_experts",
                "engine.moe.dispatch.dispatch", "engine.moe.dispatch.combine"),
    ),
    Exercise(
        name="ch10.aux_free_bias",
        title="DeepSeek-V3's aux-loss-free bias: choose with it, gate without it",
        module="ch10_aux_free_bias",
        attr="",
        checks=(check_the_bias_chooses, check_the_gates_are_unbiased, check_the_sign_update),
        hints=(
            "The bias is a nudge to the choice only: an expert that got too many tokens is "
            "made a little less attractive for the next step, by a fixed step, but the weight "
            "of its output stays what the router computed.",
            "(probs.detach() + bias).topk(k, dim=-1).indices chooses; probs.gather(-1, expert) "
            "gives the unbiased gates; torch.sign(load.mean() - load) the direction of each "
            "update (load is an integer tensor: convert it to float first).",
            "expert = (probs.detach() + bias).topk(k).indices; top = probs.gather(-1, expert); "
            "gate = top / top.sum(-1, keepdim=True) if k > 1 else top; new bias = bias + "
            "gamma * sign(load.float().mean() - load.float()).",
        ),
        blocks=("engine.moe.balance.biased_top_k", "engine.moe.balance.update_bias"),
    ),
]
