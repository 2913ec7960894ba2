"""Reference for exercise ch10.aux_free_bias (the engine's version is engine/moe/balance.py)."""

import torch


def biased_top_k(probs, bias, top_k):
    expert = (probs.detach() + bias).topk(top_k, dim=-1).indices  # the bias chooses
    top = probs.gather(-1, expert)  # the gates do not see it
    gate = top / top.sum(dim=-1, keepdim=True) if top_k > 1 else top
    return expert, gate


def update_bias(bias, load, gamma):
    load = load.to(bias.dtype)
    return bias + gamma * torch.sign(load.mean() - load)
