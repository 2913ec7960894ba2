"""Cutting a model into pipeline stages: near-equal pieces, or pieces balanced by measured
layer times. A pipeline runs at the pace of its slowest stage, so GPipe (Huang et al.,
NeurIPS 2019) cuts where the stages' estimated costs are closest; here the slowest stage is
made as fast as possible.
"""

from __future__ import annotations

from torch import nn


def uniform_boundaries(n_layers: int, parts: int) -> list[int]:
    """First layer index of each of ``parts`` near-equal consecutive pieces."""
    if parts > n_layers:
        raise ValueError(f"cannot cut {n_layers} layers into {parts} pipeline stages: each "
                         "stage needs at least one layer")
    q, r = divmod(n_layers, parts)
    starts, at = [], 0
    for i in range(parts):
        starts.append(at)
        at += q + (1 if i < r else 0)
    return starts


def balanced_boundaries(layer_times: list[float], parts: int) -> list[int]:
    """Cut layers with measured ``layer_times`` into ``parts`` consecutive pieces so that the
    slowest piece is as fast as possible (linear partitioning by dynamic programming; the
    pipeline runs at the pace of its slowest stage)."""
    n = len(layer_times)
    if parts > n:
        raise ValueError(f"cannot cut {n} layers into {parts} pipeline stages: each stage "
                         "needs at least one layer")
    prefix = [0.0]
    for t in layer_times:
        prefix.append(prefix[-1] + t)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]  # best[k][i]: first i layers, k parts
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    starts, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def split_model(layers: nn.Sequential, starts: list[int]) -> list[nn.Sequential]:
    """The pieces of ``layers`` beginning at ``starts`` (from :func:`uniform_boundaries`)."""
    n = len(layers)
    if not starts or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) \
            or starts[-1] >= n:
        raise ValueError(f"stage boundaries must start at 0, increase strictly and stay below "
                         f"the {n} layers; got {starts}")
    ends = starts[1:] + [n]
    return [nn.Sequential(*[layers[i] for i in range(a, b)]) for a, b in zip(starts, ends)]
