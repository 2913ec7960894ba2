"""Seeded construction: the same seed gives bit-identical weights on every rank."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def seeded(seed: int):
    """Run a block with the global RNG seeded, leaving the caller's RNG state untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
