"""Chapter 11's DiLoCo experiment: four replicas of a tiny GPT, DiLoCo at H = 10, 50, 100 against
data parallelism at equal tokens, and streaming DiLoCo's peak bytes per sync.

Every run starts from the same weights and sees the same tokens: ``steps`` steps, on each of
the 4 ranks a batch of ``batch`` sequences drawn for (step, rank). The data is learnable
(:func:`engine.model.data.markov_tokens`: the course's Markov chain over the vocabulary, the
one every GPT run trains on), so the loss falls well below ``ln(vocab)``. Data parallelism (DDP) all-reduces the gradients
every step and takes an AdamW step; DiLoCo (:class:`engine.ft.diloco.DiLoCo`, Douillard et al.
2023) takes H AdamW steps per replica, then one outer Nesterov step (lr 0.7, momentum 0.9)
on the averaged pseudo-gradients; streaming DiLoCo (2025) cuts the model into 4 fragments
(the embeddings with the first block, then one block each, the last with the final norm) that
sync at staggered steps. With as many fragments as blocks, the paper's strided fragments
(block i in fragment i mod F, which it prefers to consecutive runs of blocks) and consecutive
ones are the same cut.

For each run, :func:`diloco_experiment` returns the loss of the final (synced) model on a
held-out batch of the same chain beside the untrained model's loss on it (every run starts
there: without it a final loss cannot say whether the run trained), the bytes each rank sent
per token it trained on, and the largest number of bytes one rank sent at one step (the peak
a slow link must carry). Bytes are counted on the wire (:class:`engine.observe.meter.CommMeter`):
every DiLoCo sync, and DDP's first step (its every step sends the same all-reduce), next to
the formulas
(:func:`engine.theory.diloco_peak_sync_bytes`, :func:`engine.theory.ring_all_reduce_bytes`).
"""

from __future__ import annotations

import torch
from torch import nn

from engine import theory
from engine.observe.meter import CommMeter
from engine.comm import ops
from engine.ft.diloco import DiLoCo
from engine.launch import launch
from engine.model.data import markov_tokens
from engine.model.gpt import GPTConfig, TinyGPT

# a tiny GPT with 4 blocks, so that 4 fragments of whole blocks exist
CONFIG = GPTConfig(vocab=64, seq_len=16, layers=4, heads=4, hidden=32)
RUNS = (("DDP", None, 1), ("DiLoCo H=10", 10, 1), ("DiLoCo H=50", 50, 1),
        ("DiLoCo H=100", 100, 1), ("streaming DiLoCo H=100, F=4", 100, 4))


def block_fragments(model: TinyGPT, fragments: int) -> list[nn.Module]:
    """The GPT cut into ``fragments`` runs of whole blocks, the embeddings with the first and
    the final norm with the last (the tied head is the embedding's)."""
    blocks = list(model.blocks)
    per = len(blocks) // fragments
    parts = [list(blocks[i * per:(i + 1) * per]) for i in range(fragments)]
    parts[0] = [model.tok, model.pos] + parts[0]
    parts[-1] = parts[-1] + [model.ln_f]
    return [nn.ModuleList(p) for p in parts]


def _held_out_loss(model: TinyGPT) -> float:
    """The loss on 64 held-out sequences of the chain (a seed no training batch uses)."""
    with torch.no_grad():
        idx, targets = markov_tokens(64, CONFIG.seq_len, CONFIG.vocab, seed=10 ** 6)
        return model.loss(idx, targets).item()


def _train(rank, world, sync_every, fragments, batches, lr, seed):
    model = TinyGPT(CONFIG, seed=seed)
    start = _held_out_loss(model)  # the untrained model: where every run starts
    inner = torch.optim.AdamW(model.parameters(), lr=lr)
    diloco = None if sync_every is None else DiLoCo(
        model, inner, sync_every, outer_lr=0.7, outer_momentum=0.9,
        fragments=block_fragments(model, fragments) if fragments > 1 else 1)
    params = [p for p in model.parameters() if p.requires_grad]
    largest = max(f.start.numel() for f in diloco.fragments) if diloco is not None else \
        sum(p.numel() for p in params)  # what one all-reduce carries at most
    per_step, losses = [], []
    for step, (idx, targets) in enumerate(batches):
        inner.zero_grad()
        loss = model.loss(idx, targets)
        loss.backward()
        losses.append(loss.item())
        with CommMeter() as meter:  # counted on the wire
            if diloco is None:  # data parallelism: the gradients' all-reduce, every step
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                if step == 0:  # every step sends the same: counted once, then built-in
                    ops.all_reduce(flat)
            if diloco is not None:
                inner.step()
                diloco.step()
        if diloco is None:
            if step > 0:
                ops.all_reduce(flat)
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p) / world)
                offset += p.numel()
            inner.step()
        per_step.append(meter.bytes_sent if diloco is not None or step == 0 else per_step[0])
    if diloco is not None:
        diloco.finish()
    return {"start": start, "held_out": _held_out_loss(model),
            "train_last": sum(losses[-10:]) / 10, "per_step": per_step,
            "numel": sum(p.numel() for p in params), "largest": largest}


def _rank(rank, world, steps, batch, lr, seed):
    torch.set_num_threads(1)
    batches = [markov_tokens(batch, CONFIG.seq_len, CONFIG.vocab, seed=1 + 1000 * step + rank)
               for step in range(steps)]  # the same tokens for every run
    return {name: _train(rank, world, h, f, batches, lr, seed) for name, h, f in RUNS}


def diloco_experiment(steps: int = 100, batch: int = 4, replicas: int = 4, lr: float = 3e-3,
                      seed: int = 0) -> list[dict]:
    """Every run of :data:`RUNS` on ``replicas`` Gloo ranks: one row each with ``run``, ``H``,
    ``fragments``, ``start_loss`` (the untrained model on the same 64 held-out sequences),
    ``held_out_loss`` (the final model on them, rank 0's: the replicas agree after the last
    sync), ``train_loss`` (the last 10 steps' mean, rank 0's),
    ``bytes_per_token`` (sent by a rank per token it trained on), ``peak_bytes`` (the most a
    rank sent at one step, counted) and ``peak_formula`` (the ring all-reduce of the model, or
    of the largest fragment: the embeddings make the first fragment the largest, so the peak
    falls by a little less than F)."""
    # about 20 s on 2 idle cores at the defaults, more on a busy machine or with more steps:
    # past launch's 60 s default
    results = launch(_rank, replicas, steps, batch, lr, seed, backend="gloo", quiet=True,
                     timeout=600)
    tokens = steps * batch * CONFIG.seq_len
    rows = []
    for name, h, f in RUNS:
        mine = results[0][name]
        numel = mine["numel"]
        # the peak: one all-reduce of the model (DDP, DiLoCo) or of the largest fragment
        formula = theory.ring_all_reduce_bytes(mine["largest"] * 4, replicas)
        assert f > 1 or formula == theory.diloco_peak_sync_bytes(numel, replicas, 4, 1)
        rows.append({"run": name, "H": h or 1, "fragments": f,
                     "start_loss": mine["start"], "held_out_loss": mine["held_out"],
                     "train_loss": mine["train_last"],
                     "bytes_per_token": sum(mine["per_step"]) / tokens,
                     "peak_bytes": max(mine["per_step"]), "peak_formula": formula})
    return rows


def print_diloco_experiment(rows: list[dict]) -> None:
    print(f"untrained model (every run's start): held-out loss {rows[0]['start_loss']:.4f}")
    print(f"{'run':<30} {'held-out loss':>13} {'bytes/token':>12} {'peak bytes/sync':>16} "
          f"{'(formula)':>12}")
    for r in rows:
        print(f"{r['run']:<30} {r['held_out_loss']:>13.4f} {r['bytes_per_token']:>12.1f} "
              f"{r['peak_bytes']:>16,} {r['peak_formula']:>12,.0f}")


if __name__ == "__main__":
    print_diloco_experiment(diloco_experiment())
