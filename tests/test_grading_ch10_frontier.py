"""Chapter 10's frontier exercises catch plausible wrong answers, each aimed at one mistake:
the dropless dispatch that still applies a capacity, pads its splits, runs an expert once per
source rank or forgets the gates; the aux-loss-free bias added to the gates, ignored in the
choice, moved the wrong way or by the size of the error. That every check passes on
``solutions/`` and fails on the untouched stub is proved by tests/test_grading.py."""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.distributed as dist

from engine.comm import ops
from engine.grading import registry, run_checks
from engine.moe import all_to_all
from solutions import ch10_aux_free_bias as bias_answer


def _failing(name: str, impl) -> set[str]:
    return {r.name for r in run_checks(name, impl=impl).results if not r.passed}


def test_registered_with_three_hints_and_the_engine_blocked():
    for name in ("ch10.dropless_dispatch", "ch10.aux_free_bias"):
        exercise = registry()[name]
        assert len(set(exercise.hints)) == 3 and exercise.blocks, name


# -- ch10.dropless_dispatch: the solution's steps, one of them wrong ----------------------------

def _dropless(x, expert, gate, experts, num_experts, group=None, capacity=None, pad=False,
              per_source=False, gated=True):
    n = dist.get_world_size(group)
    local = num_experts // n
    tokens, k = expert.shape
    token = torch.arange(tokens).repeat_interleave(k)
    flat = expert.reshape(-1)
    keep = torch.ones(len(flat), dtype=torch.bool)
    if capacity is not None:  # the old habit: slots per expert, the rest dropped
        slots = math.ceil(tokens * k * capacity / num_experts)
        seen = torch.zeros(num_experts, dtype=torch.long)
        for i, e in enumerate(flat.tolist()):
            keep[i] = bool(seen[e] < slots)
            seen[e] += 1
    token, flat = token[keep], flat[keep]
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    sent = counts.view(n, local).sum(dim=1)
    pad_to = int(sent.max()) if pad else 0  # every split padded to this rank's largest
    header = torch.cat([counts.view(n, local), torch.full((n, 1), pad_to)], dim=1)
    incoming = torch.empty_like(header.reshape(-1))
    ops.all_to_all_single(incoming, header.reshape(-1).contiguous(), group=group)
    incoming = incoming.view(n, local + 1)
    their_pad, incoming = incoming[:, -1], incoming[:, :-1]
    received = incoming.sum(dim=1)
    rows = x[token][order]
    if pad:
        pieces = rows.split(sent.tolist())
        rows = torch.cat([torch.cat([p, p.new_zeros(pad_to - len(p), p.shape[1])])
                          for p in pieces])
        got = all_to_all(rows, their_pad.tolist(), [pad_to] * n, group)
        arrived = torch.cat([b[:r] for b, r in zip(got.split(their_pad.tolist()),
                                                    received.tolist())])
    else:
        arrived = all_to_all(rows, received.tolist(), sent.tolist(), group)
    source = torch.arange(n).repeat_interleave(local)
    my_expert = torch.arange(local).repeat(n)
    block = torch.repeat_interleave(my_expert * n + source, incoming.reshape(-1))
    regroup = torch.argsort(block, stable=True)
    if per_source:  # each expert once per source rank: the batch is not whole
        pieces = arrived.split(incoming.reshape(-1).tolist())
        y = torch.cat([experts[j % local](p) for j, p in enumerate(pieces)])
        back = all_to_all(y, sent.tolist(), received.tolist(), group)
    else:
        blocks = arrived[regroup].split(incoming.sum(dim=0).tolist())
        y = torch.cat([e(b) for e, b in zip(experts, blocks)])
        by_source = y.new_empty(y.shape).index_copy(0, regroup, y)
        back = all_to_all(by_source, sent.tolist(), received.tolist(), group)
    home = back.new_empty(back.shape).index_copy(0, order, back)
    weights = gate.reshape(-1)[keep].unsqueeze(1) if gated else 1.0
    return x.new_zeros(x.shape).index_add(0, token, home * weights)


def _module(**wrong):  # with no mistake switched on, every check passes (run by hand: 6 s)
    def dropless_moe(x, expert, gate, experts, num_experts, group=None):
        return _dropless(x, expert, gate, experts, num_experts, group, **wrong)
    return types.SimpleNamespace(dropless_moe=dropless_moe)


@pytest.mark.parametrize("wrong, failing", [
    ({"capacity": 1.25}, {"every_assignment_computed", "each_expert_once_on_its_whole_batch",
                          "uneven_all_to_all_without_padding"}),
    ({"pad": True}, {"uneven_all_to_all_without_padding"}),
    ({"per_source": True}, {"each_expert_once_on_its_whole_batch"}),
    ({"gated": False}, {"every_assignment_computed"}),
])
def test_dropless_dispatch_checks_catch_wrong_answers(wrong, failing):
    assert _failing("ch10.dropless_dispatch", _module(**wrong)) == failing


# -- ch10.aux_free_bias -------------------------------------------------------------------------

def _bias_in_the_gates(probs, bias, top_k):
    expert = (probs.detach() + bias).topk(top_k, dim=-1).indices
    top = (probs + bias).gather(-1, expert)
    return expert, top / top.sum(dim=-1, keepdim=True) if top_k > 1 else top


def _bias_ignored(probs, bias, top_k):
    return bias_answer.biased_top_k(probs, torch.zeros_like(bias), top_k)


def _sign_flipped(bias, load, gamma):
    load = load.to(bias.dtype)
    return bias + gamma * torch.sign(load - load.mean())


def _by_the_error(bias, load, gamma):
    load = load.to(bias.dtype)
    return bias + gamma * (load.mean() - load)


def _bias(select=bias_answer.biased_top_k, update=bias_answer.update_bias):
    return types.SimpleNamespace(biased_top_k=select, update_bias=update)


@pytest.mark.parametrize("impl, failing", [
    (_bias(select=_bias_in_the_gates), {"the_gates_are_unbiased"}),
    (_bias(select=_bias_ignored), {"the_bias_chooses"}),
    (_bias(update=_sign_flipped), {"the_sign_update"}),
    (_bias(update=_by_the_error), {"the_sign_update"}),
])
def test_aux_free_bias_checks_catch_wrong_answers(impl, failing):
    assert _failing("ch10.aux_free_bias", impl) == failing
