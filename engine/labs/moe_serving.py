"""Expert capacity at inference: why serving is dropless (or uses a larger capacity).

In training a dropped assignment is noise averaged over millions of tokens, and the residual
connection carries the token through. At inference it is a wrong answer for one user: the
token's output is computed without one of its experts. Worse, the capacity ``C = ceil(T k cf /
E)`` (:func:`engine.theory.expert_capacity`) and the priority order that decides who gets a
slot are computed over the **batch**: whether my token is dropped depends on how many other
tokens were batched with it and which experts they chose. So the same prompt gives different
outputs under different traffic, and a server cannot reproduce its own answers. Dropless
routing (``capacity_factor=None``, :mod:`engine.moe.dropless`) makes each token's output a
function of that token alone (DeepSeek-V3 drops no token at inference either, section 3.4, and
balances the GPUs with redundant experts instead: :mod:`engine.moe.redundant`); systems that
keep a capacity at inference raise it (Switch Transformers evaluate with a larger capacity
factor than they train with, section 2.2).

:func:`batched_outputs` runs a layer on some batchings of the same tokens (each batching: a
list of index tensors, the batches), :func:`changed_tokens` counts the tokens whose output
differs between two batchings, and :func:`batching_experiment` does both on a skewed router.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.labs.moe import zipf_bias
from engine.moe.layer import MoE


@torch.no_grad()
def batched_outputs(moe: MoE, x: torch.Tensor, batches: list[torch.Tensor]) -> torch.Tensor:
    """``moe``'s output for every row of ``x`` [T, h], each batch of row indices run as one
    forward (the layer routes, and applies its capacity, over that batch only)."""
    covered = torch.cat(batches).sort().values
    if not torch.equal(covered, torch.arange(len(x))):
        raise ValueError(f"the batches must hold each of the {len(x)} rows exactly once")
    out = torch.empty_like(x)
    was_training = moe.training
    moe.eval()
    try:
        for index in batches:
            out[index] = moe(x[index])
    finally:
        moe.train(was_training)
    return out


def changed_tokens(a: torch.Tensor, b: torch.Tensor, rows=None, tol: float = 1e-12) -> int:
    """Rows (of ``rows``, default all) whose outputs differ by more than ``tol`` anywhere."""
    diff = (a - b).abs().amax(dim=-1)
    if rows is not None:
        diff = diff[rows]
    return int((diff > tol).sum())


def skewed_layer(capacity_factor: float | None, hidden: int = 16, num_experts: int = 8,
                 top_k: int = 2, skew: float = 1.0, seed: int = 0) -> tuple[MoE, torch.Tensor]:
    """A float64 :class:`MoE` whose router prefers low-numbered experts along a shared
    direction ``u`` (as :func:`engine.labs.moe.balance_run` starts), and ``u``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        direction = F.normalize(torch.randn(hidden), dim=0)
        moe = MoE(hidden, 2 * hidden, num_experts, top_k, capacity_factor).double()
        with torch.no_grad():
            moe.router.weight.normal_(0, 1 / math.sqrt(hidden))
            moe.router.weight += zipf_bias(num_experts, skew)[:, None].double() * direction
    return moe, direction.double()


def batching_experiment(capacity_factor: float | None, tokens: int = 256, batch: int = 64,
                        user: int = 32, seed: int = 0, skew: float = 0.5, topic: float = 2.0
                        ) -> dict[str, int]:
    """The same tokens served under different batchings, on :func:`skewed_layer`; returns

    * ``"size"``: tokens (of all ``tokens``) whose output differs between one batch of all
      and batches of ``batch`` consecutive tokens;
    * ``"company"``: of one user's ``user`` tokens (queued last), those whose output differs
      when the ``tokens - user`` tokens before them are the other rows of ``x`` or requests
      on another topic (tokens shifted by ``topic`` along the router's skewed direction,
      which send more of their rows to the same hot experts);
    * ``"dropped_alone"``: the (token, expert) assignments dropped in the one-batch run.
    """
    moe, u = skewed_layer(capacity_factor, skew=skew, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, moe.hidden, generator=g, dtype=torch.float64)
    whole = batched_outputs(moe, x, [torch.arange(tokens)])
    dropped = round(moe.stats.drop_rate * tokens * moe.top_k)
    split = batched_outputs(moe, x, list(torch.arange(tokens).split(batch)))
    others = torch.randn(tokens - user, moe.hidden, generator=g, dtype=torch.float64) + topic * u
    mine, last = x[-user:], torch.arange(tokens - user, tokens)  # queued after the others
    second = batched_outputs(moe, torch.cat([others, mine]), [torch.arange(tokens)])
    return dict(size=changed_tokens(whole, split),
                company=changed_tokens(whole, second, rows=last), dropped_alone=dropped)
