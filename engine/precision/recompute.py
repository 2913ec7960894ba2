"""Activation checkpointing measured: the bytes a policy keeps for backward, the FLOPs it pays.

Four policies on :class:`engine.model.gpt.TinyGPT`, each block choosing one of ``PLANS``:

* ``none``: every block keeps what its ops save for backward;
* ``full`` (Chen et al. 2016, "Training deep nets with sublinear memory cost"): each block runs
  under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, keeps only its input and
  runs its forward again in backward;
* ``selective`` (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", section 5): only the attention core (``Q K^T``, mask, softmax, ``@ V``)
  is recomputed: its ``s x s`` tensors are the large ones, its matmuls a few FLOPs;
* a memory budget (:func:`budget_plan`): starting from ``none``, the move with the most bytes
  saved per FLOP added (a block to ``selective``, to ``full``, or ``selective`` to ``full``) is
  taken until the bytes fit. (PyTorch's ``torch.compile`` has a solver of the same kind,
  ``activation_memory_budget``; this one is greedy, on the measured costs.)

Counted, not estimated: a ``torch.autograd.graph.saved_tensors_hooks`` pack hook sees every
tensor autograd saves outside a checkpointed region; each distinct storage counts once, its
bytes to the block (or ``outside``) that saved it first; parameters are left out (they are held
anyway); the inputs a checkpoint holds to run again are counted too. The FLOPs are
``torch.utils.flop_counter.FlopCounterMode``'s over forward and backward, recomputation
included; it counts matmuls only, so recomputing a softmax costs no FLOPs in this count, and
recomputation stops early (:func:`tiny_gpt_flops_per_layer`). Recomputing runs the same ops on
the same inputs, so every policy's gradients are bit-identical to ``none``'s (tested).

Against the paper's per-layer bytes (its eq. 1, t = 1, fp16, with dropout;
:func:`engine.theory.recompute_activation_bytes_per_layer`): ``34 sbh + 5 as^2 b`` without
recomputation, ``34 sbh`` selective, ``2 sbh`` full. The tiny GPT keeps the same 16
``sbh``-sized tensors (LayerNorm inputs, the linear layers' inputs, Q, K, V, the GELU's input),
but in fp32 (4 bytes each, not 2), with no dropout (the paper's two ``sbh`` one-byte masks, its
``as^2 b`` mask and ``2 as^2 b`` dropout output are not there), and saves besides each
LayerNorm's mean and 1/std (``2 sb`` fp32 each) and the causal mask (``s^2`` bools); its softmax
output is ``4 as^2 b`` bytes. So, per layer, exactly (:func:`tiny_gpt_bytes_per_layer`, tested):
``64 sbh + 16 sb + 4 as^2 b + s^2`` (none), ``64 sbh + 16 sb`` (selective), ``4 sbh`` (full).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from engine.model.attention import causal_attention
from engine.model.gpt import GPTConfig, TinyGPT
from engine.model.data import token_data

PLANS = ("none", "selective", "full")


class SavedBytes:
    """Pack/unpack hooks counting each distinct storage saved for backward once, by region."""

    def __init__(self, leave_out=()):
        self.leave_out = {t.untyped_storage().data_ptr() for t in leave_out}
        self.seen: dict[int, tuple[str, int]] = {}  # storage address -> (region, bytes)
        self.region = "outside"

    def add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        where = storage.data_ptr()
        if storage.nbytes() and where not in self.leave_out and where not in self.seen:
            self.seen[where] = (self.region, storage.nbytes())

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.add(tensor)
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def by_region(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for region, nbytes in self.seen.values():
            out[region] = out.get(region, 0) + nbytes
        return out


def block_forward(block, x: torch.Tensor, plan: str, counter: SavedBytes) -> torch.Tensor:
    """:class:`engine.model.gpt.Block`'s forward, op for op, under ``plan``."""
    if plan == "full":
        counter.add(x)  # what the checkpoint holds to run the block again
        return checkpoint(block, x, use_reentrant=False)
    attn = block.attn
    h = block.ln1(x)
    b, s, hidden = h.shape
    q, k, v = attn.qkv(h).split(hidden, dim=2)
    q, k, v = (t.view(b, s, attn.heads, hidden // attn.heads).transpose(1, 2) for t in (q, k, v))
    if plan == "selective":
        for t in (q, k, v):
            counter.add(t)  # views of the q/k/v projection's output, kept
        y = checkpoint(causal_attention, q, k, v, use_reentrant=False)
    else:
        y = causal_attention(q, k, v)
    x = x + attn.proj(y.transpose(1, 2).reshape(b, s, hidden))
    return x + block.out(F.gelu(block.fc(block.ln2(x))))


def gpt_forward(model: TinyGPT, idx: torch.Tensor, plans, counter: SavedBytes) -> torch.Tensor:
    """:meth:`engine.model.gpt.TinyGPT.forward` with one plan per block; the bytes each block
    saves are counted under its index."""
    b, s = idx.shape
    x = model.tok(idx) + model.pos(torch.arange(s, device=idx.device))
    for i, (block, plan) in enumerate(zip(model.blocks, plans)):
        counter.region = f"block {i}"
        x = block_forward(block, x, plan, counter)
    counter.region = "outside"
    return model.head(model.ln_f(x))


@dataclass
class Recompute:
    plans: tuple[str, ...]
    saved: dict[str, int]  # bytes saved for backward, by region ("block i", "outside")
    forward_flops: int
    flops: int  # forward + backward, recomputation included
    grads: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)

    @property
    def saved_bytes(self) -> int:
        return sum(self.saved.values())

    @property
    def label(self) -> str:
        return self.plans[0] if len(set(self.plans)) == 1 else "+".join(p[0] for p in self.plans)


def check_plans(cfg: GPTConfig, plans) -> tuple[str, ...]:
    if isinstance(plans, str):
        plans = (plans,) * cfg.layers
    plans = tuple(plans)
    if len(plans) != cfg.layers or any(p not in PLANS for p in plans):
        raise ValueError(f"plans={plans!r}: expected one of {PLANS} or {cfg.layers} of them "
                         "(one per block)")
    return plans


def measure(cfg: GPTConfig, plans="none", batch: int = 2, seed: int = 0) -> Recompute:
    """One forward and backward of the tiny GPT under ``plans`` (a policy name for every
    block, or one per block): the bytes saved for backward, the FLOPs, the gradients."""
    plans = check_plans(cfg, plans)
    model = TinyGPT(cfg, seed=seed)
    idx, targets = token_data(batch, cfg.seq_len, cfg.vocab, seed=seed + 1)
    counter = SavedBytes(model.parameters())
    with FlopCounterMode(display=False) as flops:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            logits = gpt_forward(model, idx, plans, counter)
            loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), targets.reshape(-1))
        forward_flops = flops.get_total_flops()
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return Recompute(plans, counter.by_region(), forward_flops, flops.get_total_flops(), grads)


def tiny_gpt_bytes_per_layer(cfg: GPTConfig, batch: int, plan: str) -> int:
    """The bytes one tiny-GPT block saves for backward, from its ops (module docstring)."""
    s, b, h, a = cfg.seq_len, batch, cfg.hidden, cfg.heads
    if plan == "full":
        return 4 * s * b * h
    kept = 64 * s * b * h + 16 * s * b
    return kept if plan == "selective" else kept + 4 * a * s * s * b + s * s


def tiny_gpt_flops_per_layer(cfg: GPTConfig, batch: int, plan: str = "none") -> int:
    """One block's matmul FLOPs, forward and backward, recomputation included. Forward
    ``24 bsh^2 + 4 bs^2 h`` (Narayanan et al. 2021, eq. 2 per layer), backward twice that.
    Recomputation adds less than a forward: PyTorch's non-reentrant checkpoint stops rerunning
    a region once the last tensor backward needs from it is rebuilt
    (``torch.utils.checkpoint.set_checkpoint_early_stop``, on by default), so ``full`` does
    not rerun the MLP's second linear (``+16 bsh^2 + 4 bs^2 h``) and ``selective`` not the
    ``@ V`` (``+2 bs^2 h``, ``Q K^T`` only)."""
    s, b, h = cfg.seq_len, batch, cfg.hidden
    forward = 24 * b * s * h * h + 4 * b * s * s * h
    extra = {"none": 0, "selective": 2 * b * s * s * h,
             "full": 16 * b * s * h * h + 4 * b * s * s * h}[plan]
    return 3 * forward + extra


def per_block_costs(runs: dict[str, Recompute]) -> dict[str, tuple[int, int]]:
    """(bytes saved, FLOPs added against ``none``) of one block under each plan, from the
    uniform runs ``{plan: measure(cfg, plan)}`` (block 0's bytes; every block is alike)."""
    layers = len(runs["none"].plans)
    return {plan: (run.saved["block 0"], (run.flops - runs["none"].flops) // layers)
            for plan, run in runs.items()}


def budget_plan(costs: dict[str, tuple[int, int]], layers: int, budget: int,
                outside: int = 0) -> tuple[str, ...]:
    """Per-block plans whose bytes (plus ``outside``) fit ``budget``: from ``none``, take the
    move that saves the most bytes per FLOP added until they fit."""
    plans = ["none"] * layers
    total = outside + layers * costs["none"][0]
    while total > budget:
        moves = [((costs[plan][0] - costs[to][0]) / (costs[to][1] - costs[plan][1]), i, to)
                 for i, plan in enumerate(plans) for to in PLANS[PLANS.index(plan) + 1:]]
        if not moves:
            least = outside + layers * costs["full"][0]
            raise ValueError(f"budget={budget} bytes: below {least}, what full recomputation "
                             "of every block keeps")
        _, i, to = max(moves)
        total -= costs[plans[i]][0] - costs[to][0]
        plans[i] = to
    return tuple(plans)


def pareto(cfg: GPTConfig, batch: int = 2, budgets: int = 12) -> list[Recompute]:
    """The uniform policies and the budget plans for ``budgets`` budgets between them."""
    runs = {plan: measure(cfg, plan, batch) for plan in PLANS}
    costs = per_block_costs(runs)
    outside = runs["none"].saved["outside"]
    high, low = runs["none"].saved_bytes, runs["full"].saved_bytes
    seen: set[tuple[str, ...]] = set()
    out = list(runs.values())
    for step in range(1, budgets):
        plans = budget_plan(costs, cfg.layers, low + (high - low) * step // budgets, outside)
        if plans not in seen and len(set(plans)) > 1:
            seen.add(plans)
            out.append(measure(cfg, plans, batch))
    return out
