"""Reference for exercise ch12.newton_schulz (the engine's version is
engine/optim/newton_schulz.py)."""

import torch  # noqa: F401

COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's (a, b, c)


def newton_schulz(g, steps=5):
    a, b, c = COEFFICIENTS
    tall = g.size(0) > g.size(1)
    x = g.float().T if tall else g.float()
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x
