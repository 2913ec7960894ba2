"""Context-parallel methods side by side: bytes each GPU sends and buffers it holds, against N.

Ring attention, Ulysses (KV heads replicated past their count), all-gather context
parallelism (Llama 3) and 2D attention (Ulysses inside a node of ``node`` GPUs, ring across),
per GPU and per attention layer, from :mod:`engine.theory` (:func:`~engine.theory.
ring_attention_bytes`, :func:`~engine.theory.ulysses_bytes`, :func:`~engine.theory.
allgather_cp_bytes`, :func:`~engine.theory.usp_bytes` and :func:`~engine.theory.
cp_memory_bytes`), the formulas the engine's counted runs equal (tests/test_cp_frontier.py).
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt

from engine import theory
from engine.viz.style import apply_style

METHODS = ("ring", "Ulysses", "all-gather", "2D")


def _two_d(n: int, heads: int, node: int) -> tuple[int, int] | None:
    """``(ulysses, ring)`` for 2D attention on ``n`` GPUs: Ulysses over as many GPUs of a node
    as divide the query heads, ring across; None when that leaves no ring (plain Ulysses)."""
    u = math.gcd(math.gcd(n, node), heads)
    return (u, n // u) if 1 < u < n else None


def cp_method_rows(ns, seq: int = 131072, heads: int = 32, kv_heads: int = 8,
                   head_dim: int = 128, dtype_bytes: int = 2, node: int = 8
                   ) -> dict[str, dict[int, dict[str, float] | None]]:
    """``{method: {N: {"forward bytes", "backward bytes", "forward buffers", "backward
    buffers"} or None where the method cannot run}}`` per GPU per layer; ``seq`` tokens
    (batch x sequence), fp32 accumulation."""
    kv_hidden = kv_heads * head_dim
    rows: dict[str, dict] = {m: {} for m in METHODS}
    for n in ns:
        def entry(sent, held):
            return {"forward bytes": sent["forward"], "backward bytes": sent["backward"],
                    "forward buffers": held["forward"], "backward buffers": held["backward"]}

        rows["ring"][n] = entry(theory.ring_attention_bytes(seq, kv_hidden, n, dtype_bytes),
                                theory.cp_memory_bytes("ring", seq, heads, kv_heads, head_dim,
                                                       n, dtype_bytes))
        rows["all-gather"][n] = entry(theory.allgather_cp_bytes(seq, kv_hidden, n, dtype_bytes),
                                      theory.cp_memory_bytes("allgather", seq, heads, kv_heads,
                                                             head_dim, n, dtype_bytes))
        if heads % n:
            rows["Ulysses"][n] = None
        else:
            travelling = theory.ulysses_sent_kv_heads(heads, kv_heads, n)
            rows["Ulysses"][n] = entry(
                theory.ulysses_bytes(seq, heads * head_dim, n, dtype_bytes,
                                     travelling * head_dim),
                theory.cp_memory_bytes("ulysses", seq, heads, kv_heads, head_dim, n,
                                       dtype_bytes))
        split = _two_d(n, heads, node)
        rows["2D"][n] = None if split is None else entry(
            theory.usp_bytes(seq, heads, kv_heads, head_dim, *split, dtype_bytes),
            theory.cp_memory_bytes("usp", seq, heads, kv_heads, head_dim, n, dtype_bytes,
                                   ulysses=split[0]))
    return rows


def cp_methods_figure(ns=(2, 4, 8, 16, 32, 64), seq: int = 131072, heads: int = 32,
                      kv_heads: int = 8, head_dim: int = 128, dtype_bytes: int = 2,
                      node: int = 8):
    """Left: GB each GPU sends per layer (forward + backward); right: the most GB of working
    buffers it holds in the layer's backward (forward for Ulysses), both against N."""
    apply_style()
    rows = cp_method_rows(ns, seq, heads, kv_heads, head_dim, dtype_bytes, node)
    fig, (sent, held) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"ring": "C2-s", "Ulysses": "C3-^", "all-gather": "C0:o", "2D": "C1--D"}
    widths = {"ring": 5, "Ulysses": 1.5, "all-gather": 2, "2D": 1.5}  # ring under all-gather
    for method, style in styles.items():
        points = [(n, r) for n, r in rows[method].items() if r is not None]
        xs = [n for n, _ in points]
        phase = "forward" if method == "Ulysses" else "backward"
        sent.plot(xs, [(r["forward bytes"] + r["backward bytes"]) / 1e9 for _, r in points],
                  style, label=method, lw=widths[method], alpha=0.6 if method == "ring" else 1)
        held.plot(xs, [r[f"{phase} buffers"] / 1e9 for _, r in points], style, label=method,
                  lw=widths[method], alpha=0.6 if method == "ring" else 1)
    for ax in (sent, held):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context-parallel GPUs N")
        ax.set_xticks(list(ns), [str(n) for n in ns])
        ax.legend(fontsize=8)
    sent.set_ylabel("GB sent per GPU per layer (fwd + bwd)")
    held.set_ylabel("GB of K/V-sized buffers at the peak")
    sent.set_title(f"{seq:,} tokens, {heads} query / {kv_heads} KV heads of {head_dim}, "
                   f"{8 * dtype_bytes}-bit (ring = all-gather)", fontsize=10)
    held.set_title(f"2D = Ulysses over up to {node} GPUs of a node, ring across", fontsize=10)
    fig.tight_layout()
    return fig
