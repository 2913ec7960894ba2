"""Precision and memory items (chapter 12): mixed precision and loss scaling, FSDP2, FP8 scaling, activation checkpointing, Muon.

Answers are computed by :mod:`engine.theory` (numeric items) or settled by a measurement in
the chapter (choice items); every item names the chapter section that teaches it.
"""

from __future__ import annotations

ITEMS: list = []  # Numeric, Choice and Outline items of topic 'precision and memory'
