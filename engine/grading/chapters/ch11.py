"""Checks for chapter 11: DiLoCo's outer Nesterov step, the average over a quorum's live
replicas on real processes, Young's checkpoint interval; drills on DiLoCo's bytes, HSDP and
the checkpoint interval."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from engine import theory
from engine.ft import Quorum
from engine.grading.core import CheckFailed, Exercise, passed, run_here, run_ranks
from engine.grading.drill import Drill

# -- ch11.diloco_outer_step -------------------------------------------------------------------

HIDDEN_OUTER = [  # (numel, replicas, outer lr, momentum, nesterov, outer steps)
    (7, 2, 0.7, 0.9, True, 4),
    (12, 4, 0.5, 0.8, True, 5),
    (5, 3, 1.0, 0.9, False, 4),
    (9, 1, 0.3, 0.95, True, 3),
]


def _outer_inputs(numel, replicas, seed):
    g = torch.Generator().manual_seed(seed)
    start = torch.randn(numel, generator=g)
    drift = 0.1 * torch.randn(numel, generator=g)  # the replicas move the same way, roughly
    ends = [start - drift + 0.05 * torch.randn(numel, generator=g) for _ in range(replicas)]
    return start, ends


def _torch_outer(start, ends, lr, momentum, buffer, nesterov):
    """The engine's convention (engine.ft.diloco.Fragment): torch.optim.SGD on the start point,
    fed the mean pseudo-gradient as its gradient."""
    theta = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([theta], lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)
    if momentum:
        sgd.state[theta]["momentum_buffer"] = buffer.clone()
    theta.grad = start - torch.stack(ends).mean(0)
    sgd.step()
    new_buffer = sgd.state[theta].get("momentum_buffer", torch.zeros_like(start))
    return theta.detach().clone(), new_buffer.detach().clone()


def _call_outer(impl, start, ends, lr, momentum, buffer, nesterov, inputs):
    got = impl(start.clone(), [e.clone() for e in ends], lr, momentum, buffer.clone(),
               nesterov=nesterov)
    if not (isinstance(got, tuple) and len(got) == 2
            and all(isinstance(t, torch.Tensor) for t in got)):
        raise CheckFailed("return a tuple (new_params, new_buffer) of tensors", **inputs)
    params, new_buffer = (t.detach() for t in got)
    if params.shape != start.shape or new_buffer.shape != start.shape:
        raise CheckFailed(f"new_params and new_buffer must have the parameters' shape "
                          f"{tuple(start.shape)}, got {tuple(params.shape)} and "
                          f"{tuple(new_buffer.shape)}", **inputs)
    return params, new_buffer


def _what_the_step_says(got, start, ends, lr) -> str:
    """The mistake a momentum-free outer step shows, named only when it is that one."""
    delta = start - torch.stack(ends).mean(0)
    known = [("the pseudo-gradient's sign is flipped: it is start - end (it points uphill, "
              "like a gradient), and the step subtracts it", start + lr * delta)]
    if len(ends) > 1:
        known.append(("the pseudo-gradients are summed over the replicas: average them",
                      start - lr * len(ends) * delta))
    if lr != 1:
        known.append(("the outer learning rate is not applied (that is plain parameter "
                      "averaging): theta - outer_lr * delta", start - delta))
    for mistake, value in known:
        if torch.allclose(got, value, atol=1e-6):
            return mistake
    return "theta - outer_lr * delta, with delta = the mean over replicas of (start - end)"


def check_one_outer_step_from_rest(impl):
    for numel, replicas, lr, _, nesterov, _ in HIDDEN_OUTER:
        inputs = dict(numel=numel, replicas=replicas, outer_lr=lr, momentum=0.0)
        start, ends = _outer_inputs(numel, replicas, seed=numel)
        zeros = torch.zeros(numel)
        params, _ = _call_outer(impl, start, ends, lr, 0.0, zeros, nesterov, inputs)
        want, _ = _torch_outer(start, ends, lr, 0.0, zeros, nesterov)
        if not torch.allclose(params, want, atol=1e-6):
            raise CheckFailed("without momentum the new parameters are wrong: "
                              + _what_the_step_says(params, start, ends, lr), **inputs)


def check_nesterov_momentum_over_outer_steps(impl):
    worst = 0.0
    for numel, replicas, lr, momentum, nesterov, steps in HIDDEN_OUTER:
        inputs = dict(numel=numel, replicas=replicas, outer_lr=lr, momentum=momentum,
                      nesterov=nesterov)
        theta, buffer = _outer_inputs(numel, replicas, seed=100 + numel)[0], torch.zeros(numel)
        want_theta, want_buffer = theta.clone(), buffer.clone()
        for step in range(steps):
            origin, moved = _outer_inputs(numel, replicas, seed=1000 * step + numel)
            ends = [theta + (e - origin) for e in moved]  # H inner steps from the current theta
            theta, buffer = _call_outer(impl, theta, ends, lr, momentum, buffer, nesterov,
                                        dict(outer_step=step + 1, **inputs))
            want_theta, want_buffer = _torch_outer(want_theta, ends, lr, momentum, want_buffer,
                                                   nesterov)
            if not torch.allclose(buffer, want_buffer, atol=1e-6):
                raise CheckFailed(f"after outer step {step + 1} the momentum buffer is wrong: "
                                  "m = momentum * m + delta (torch.optim.SGD's buffer, no "
                                  "dampening)", outer_step=step + 1, **inputs)
            if not torch.allclose(theta, want_theta, atol=1e-6):
                raise CheckFailed(f"after outer step {step + 1} the parameters are wrong: "
                                  + ("with Nesterov the step is outer_lr * (delta + momentum "
                                     "* m), m already updated" if nesterov else
                                     "without Nesterov the step is outer_lr * m"),
                                  outer_step=step + 1, **inputs)
            worst = max(worst, (theta - want_theta).abs().max().item())
    return passed(f"{len(HIDDEN_OUTER)} runs of outer steps within {worst:.1e}",
                  "torch.optim.SGD(nesterov=True) on start - mean(end)")


def _outer_in_place(impl, start, ends, lr, momentum, buffer, nesterov):
    """A driver (runs where the learner's code does): one outer step, then the inputs as the
    step left them, and whether a returned tensor is one of them. The check compares them in
    the grader with the inputs it sent."""
    got = impl(start, ends, lr, momentum, buffer, nesterov=nesterov)
    return dict(start=start.clone(), ends=[e.clone() for e in ends], buffer=buffer.clone(),
                returned_an_input=isinstance(got, tuple)
                and any(t is start or t is buffer for t in got))


def check_inputs_left_intact(impl):
    numel, replicas, lr, momentum, nesterov, _ = HIDDEN_OUTER[1]
    start, ends = _outer_inputs(numel, replicas, seed=7)
    buffer = 0.1 * torch.ones(numel)
    seen = run_here(_outer_in_place, impl, start.clone(), [e.clone() for e in ends], lr,
                    momentum, buffer.clone(), nesterov)  # copies: a local run shares them
    inputs = dict(numel=numel, replicas=replicas)
    if not (torch.equal(seen["start"], start) and torch.equal(seen["buffer"], buffer)
            and len(seen["ends"]) == len(ends)
            and all(torch.equal(a, b) for a, b in zip(seen["ends"], ends))):
        raise CheckFailed("the inputs were changed in place: return new tensors (the caller "
                          "keeps start and the buffer to compare, or to retry a failed sync)",
                          **inputs)
    if seen["returned_an_input"]:
        raise CheckFailed("a returned tensor is one of the inputs: return new tensors",
                          **inputs)


# -- ch11.quorum_average ----------------------------------------------------------------------

REPLICAS = 4
QUORUMS = [(0, 2, 3), (1,), (0, 1, 2, 3), (1, 3)]  # replica 1 absent first, then 0 and 2 ...


def _replica_tensor(replica: int, case: int) -> torch.Tensor:
    """Whole numbers, so that any order of summation gives the same bits."""
    return torch.arange(6, dtype=torch.float32) * (replica + 1) + 10 * replica + case


# how Gloo says a peer is gone: closed or reset while this rank reads, or never came
PEER_GONE = ("Connection closed", "Read error", "Connection reset", "Broken pipe", "imed out",
             "Timeout")


def _quorum_on_rank(rank, world_size, impl, timeout_s):
    """A driver (runs where the learner's code does): each quorum's members call the learner's
    function over the store the replicas share; it returns what each saw (the tensor returned,
    the input as the call left it, whether the input itself came back, or the error of a peer
    gone). The check compares them in the grader.

    The store is the launch's own (its rendezvous), under a prefix of this check: served where
    the ranks run, so the ranks reach it wherever they run (a sandbox has no network but its
    own loopback)."""
    store = dist.PrefixStore("ch11.quorum_average/", dist.distributed_c10d._get_default_store())
    out = []
    for case, members in enumerate(QUORUMS):
        if rank not in members:  # absent: dead or late, it never calls
            out.append(None)
            continue
        quorum = Quorum(step=case, attempt=0, members=members,
                        completed={m: case for m in members}, incarnations={m: 0 for m in members},
                        qid=f"check-{case}")
        mine = _replica_tensor(rank, case)
        try:
            got = impl(mine, quorum, rank, store, timeout_s)
        except NotImplementedError:
            raise
        except RuntimeError as e:  # a peer gone: the group waited on, or paired with, an absent one
            if not any(w in str(e) for w in PEER_GONE):
                raise
            out.append(dict(error=str(e).splitlines()[0][:160]))
            continue
        out.append(dict(got=got.detach().clone() if isinstance(got, torch.Tensor) else None,
                        after=mine.clone(), same_object=got is mine))
    return out


_last: dict = {}  # the latest impl's results: the two checks share one run


def _quorum_results(impl):
    if _last.get("impl") is not impl:
        results = run_ranks(_quorum_on_rank, REPLICAS, impl, 10.0, timeout=20)
        _last.update(impl=impl, results=results)
    return _last["results"]


def check_mean_over_the_live_replicas(impl):
    results = _quorum_results(impl)
    for rank, cases in enumerate(results):  # a failed all-reduce says the most: first
        for members, r in zip(QUORUMS, cases):
            if r is not None and "error" in r:
                raise CheckFailed(f"replica {rank}: its all-reduce failed ({r['error']}). Only "
                                  "the quorum's members call quorum_average: a group of every "
                                  "replica (the default process group) waits on, or pairs with, "
                                  "replicas that are absent. Build a group of the members only",
                                  replica=rank, members=list(members), replicas=REPLICAS)
    for rank, cases in enumerate(results):
        for case, (members, r) in enumerate(zip(QUORUMS, cases)):
            if r is None:
                continue
            inputs = dict(replica=rank, members=list(members), replicas=REPLICAS)
            if r["got"] is None:
                raise CheckFailed("return the average as a tensor", **inputs)
            total = sum(_replica_tensor(m, case) for m in members)
            want = total / len(members)
            got = r["got"]
            if got.shape == want.shape and torch.allclose(got, want, atol=1e-6):
                continue
            if got.shape == want.shape and len(members) < REPLICAS and torch.allclose(
                    got, total / REPLICAS, atol=1e-6):
                why = (f"it is the members' sum divided by {REPLICAS}, every replica: divide "
                       f"by the {len(members)} members of the quorum")
            elif got.shape == want.shape and len(members) > 1 and torch.allclose(got, total):
                why = "it is the members' sum: divide it by the number of members"
            elif got.shape == want.shape and len(members) > 1 and torch.equal(
                    got, _replica_tensor(rank, case)):
                why = "it is this replica's own tensor: all-reduce it over the quorum's group"
            else:
                why = "the mean over the quorum's members, sum / len(quorum.members)"
            raise CheckFailed(f"replica {rank} got the wrong average: {why}", **inputs)
    return passed(f"every member of {len(QUORUMS)} quorums got the mean",
                  "sum over the members / len(members)", replicas=REPLICAS)


def check_input_left_intact(impl):
    for rank, cases in enumerate(_quorum_results(impl)):
        for case, (members, r) in enumerate(zip(QUORUMS, cases)):
            if r is not None and "error" not in r and (r["same_object"] or not torch.equal(
                    r["after"], _replica_tensor(rank, case))):
                raise CheckFailed(f"replica {rank}: the input tensor was changed in place: "
                                  "all-reduce a copy (the caller keeps its gradient to retry "
                                  "the step if a member dies mid-all-reduce)",
                                  replica=rank, members=list(members))


# -- ch11.checkpoint_interval -----------------------------------------------------------------

HOUR = 3600.0
HIDDEN_WASTE = [  # (interval T, checkpoint C, MTBF M), seconds
    (1315.0, 60.0, 4 * HOUR), (600.0, 30.0, 2 * HOUR), (3600.0, 300.0, 24 * HOUR),
    (120.0, 5.0, 0.5 * HOUR), (900.0, 90.0, 6 * HOUR),
]
HIDDEN_YOUNG = [(60.0, 4 * HOUR), (30.0, 2 * HOUR), (300.0, 24 * HOUR), (5.0, 0.5 * HOUR),
                (12.0, 3 * HOUR)]


def _ratio_says(ratio: float, known: dict[float, str]) -> str:
    for factor, mistake in known.items():
        if abs(ratio - factor) < 1e-6 * factor:
            return f": {mistake}"
    return ""


def check_waste_per_second(module):
    for t, c, m in HIDDEN_WASTE:
        got = module.waste_per_second(t, c, m)
        want = theory.checkpoint_waste(t, c, m)
        if not math.isclose(got, want, rel_tol=1e-9):
            swapped = m / t + t / (2 * c)
            why = (": C and M are swapped: the checkpoints cost C/T, the failures T/(2M)"
                   if math.isclose(got, swapped, rel_tol=1e-9) else
                   ": a failure loses half an interval on average, T/(2M), not T/M"
                   if math.isclose(got, c / t + t / m, rel_tol=1e-9) else
                   ": C/T (checkpoints) + T/(2M) (the work lost per failure)")
            raise CheckFailed(f"got {got:.6g}, expected {want:.6g}{why}", interval_s=t,
                              checkpoint_s=c, mtbf_s=m)


def check_young_interval(module):
    for c, m in HIDDEN_YOUNG:
        got = module.young_interval(c, m)
        want = theory.young_checkpoint_interval(c, m)
        if not math.isclose(got, want, rel_tol=1e-9):
            why = _ratio_says(got / want, {
                1 / math.sqrt(2): "the 2 is missing: sqrt(2 C M)",
                2 / math.sqrt(2): "2 sits outside the square root: sqrt(2 C M)",
            })
            raise CheckFailed(f"got {got:.6g} s, expected {want:.6g} s{why} (set the derivative "
                              "of C/T + T/(2M) to zero)", checkpoint_s=c, mtbf_s=m)
    c, m = HIDDEN_YOUNG[0]
    return passed(f"T* = {module.young_interval(c, m):.0f} s", "sqrt(2 C M)", C=c, M=m)


EXERCISES = [
    Exercise(
        name="ch11.diloco_outer_step",
        title="DiLoCo's outer step: the pseudo-gradient and Nesterov momentum",
        module="ch11_diloco_outer_step",
        attr="outer_step",
        checks=(check_one_outer_step_from_rest, check_nesterov_momentum_over_outer_steps,
                check_inputs_left_intact),
        hints=(
            "Treat start - (the replicas' mean end point) as a gradient, and take one step of "
            "SGD with Nesterov momentum on the start point with it: the outer optimizer only "
            "ever sees this pseudo-gradient.",
            "torch.stack(ends).mean(dim=0) averages the replicas; the buffer update and the "
            "Nesterov step are torch.optim.SGD's (dampening 0): plain tensor arithmetic, no "
            "in-place ops on the inputs.",
            "delta = start - stack(ends).mean(0); m = momentum * buffer + delta; update = "
            "delta + momentum * m if nesterov else m; return start - outer_lr * update, m.",
        ),
        blocks=("engine.ft.diloco.DiLoCo.step", "engine.ft.diloco.DiLoCo.finish"),
    ),
    Exercise(
        name="ch11.quorum_average",
        title="The average over a quorum's live replicas",
        module="ch11_quorum_average",
        attr="quorum_average",
        checks=(check_mean_over_the_live_replicas, check_input_left_intact),
        hints=(
            "Only the quorum's members call you, so no group of every replica will do: build a "
            "group of exactly the members, all-reduce a copy over it, and divide by how many "
            "they are (not by how many replicas exist).",
            "dist.PrefixStore(f\"...{quorum.qid}/\", store) gives each quorum its own keys; "
            "dist.ProcessGroupGloo(that_store, quorum.rank_of(replica), len(quorum.members), "
            "datetime.timedelta(seconds=timeout_s)); pg.allreduce([t]).wait() sums in place.",
            "pg = ProcessGroupGloo(PrefixStore(f\"q/{quorum.qid}/\", store), "
            "quorum.rank_of(replica), len(quorum.members), timedelta(seconds=timeout_s)); "
            "out = tensor.detach().clone(); pg.allreduce([out]).wait(); return out / "
            "len(quorum.members).",
        ),
        blocks=("engine.ft.group.QuorumGroup.use", "engine.ft.group.QuorumGroup.average"),
    ),
    Exercise(
        name="ch11.checkpoint_interval",
        title="Young's checkpoint interval and the waste it minimises",
        module="ch11_checkpoint_interval",
        attr="",
        checks=(check_waste_per_second, check_young_interval),
        hints=(
            "Two costs pull against each other: checkpoint often and you pay C every T "
            "seconds; checkpoint rarely and each failure (one every M seconds) throws away, on "
            "average, half an interval of work.",
            "Only arithmetic: the waste is a sum of two terms in T, C and M; its minimum is "
            "where its derivative in T is zero (math.sqrt).",
            "waste = C / T + T / (2 * M); d/dT = -C / T**2 + 1 / (2 * M) = 0 gives "
            "T = math.sqrt(2 * C * M).",
        ),
        blocks=("engine.theory.checkpoint_waste", "engine.theory.young_checkpoint_interval"),
    ),
]

DRILLS = [  # questions from engine.drill's bank: the answers are computed, not typed
    Drill("ch11.diloco_saving", "diloco-bytes-saving"),
    Drill("ch11.hsdp_bytes", "hsdp-replica-bytes"),
    Drill("ch11.young", "young-interval"),
]
