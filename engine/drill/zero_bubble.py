"""Zero-bubble pipeline items (chapter 06): ZB-H2, the memory each schedule holds.

Answers are computed by :mod:`engine.theory` (numeric items) or settled by a measurement in
the chapter (choice items); every item names the chapter section that teaches it.
"""

from __future__ import annotations

ITEMS: list = []  # Numeric, Choice and Outline items of topic 'pipeline'
