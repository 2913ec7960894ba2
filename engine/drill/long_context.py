"""Long-context items (chapter 09): Ulysses past the KV heads, all-gather and 2D context parallelism, striped layouts, the memory each method holds.

Answers are computed by :mod:`engine.theory` (numeric items) or settled by a measurement in
the chapter (choice items); every item names the chapter section that teaches it.
"""

from __future__ import annotations

ITEMS: list = []  # Numeric, Choice and Outline items of topic 'long context'
