"""Items on training across slow links and failures (chapter 11): DiLoCo, HSDP, per-step fault tolerance, checkpoint intervals, stragglers.

Answers are computed by :mod:`engine.theory` (numeric items) or settled by a measurement in
the chapter (choice items); every item names the chapter section that teaches it.
"""

from __future__ import annotations

ITEMS: list = []  # Numeric, Choice and Outline items of topic 'slow links and failures'
