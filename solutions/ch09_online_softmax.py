"""Reference for ch09.online_softmax (see exercises/ch09_online_softmax.py)."""

import torch


def merge(out_1, lse_1, out_2, lse_2):
    lse = torch.logaddexp(lse_1, lse_2)
    out = (out_1 * torch.exp(lse_1 - lse).unsqueeze(-1)
           + out_2 * torch.exp(lse_2 - lse).unsqueeze(-1))
    return out, lse
