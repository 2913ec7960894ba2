"""Reference for exercise ch10.router (the engine's version is engine/moe/router.py)."""

import math

import torch


def top_k_route(logits, top_k, capacity_factor):
    tokens, experts = logits.shape
    probs = logits.softmax(dim=-1)
    top, expert = probs.topk(top_k, dim=-1)
    gate = top / top.sum(dim=-1, keepdim=True) if top_k > 1 else top
    capacity = math.ceil(tokens * top_k * capacity_factor / experts)
    taken = torch.zeros(experts, dtype=torch.long)
    keep = torch.zeros(tokens, top_k, dtype=torch.bool)
    for j in range(top_k):  # first choices first, then second choices, ...
        for t in range(tokens):  # ... each in token order
            e = expert[t, j]
            if taken[e] < capacity:
                keep[t, j] = True
                taken[e] += 1
    return expert, gate, keep
