"""Mixture-of-experts items (chapter 10): dropless routing, aux-loss-free balancing, shared and fine-grained experts, published model sizes.

Answers are computed by :mod:`engine.theory` (numeric items) or settled by a measurement in
the chapter (choice items); every item names the chapter section that teaches it.
"""

from __future__ import annotations

ITEMS: list = []  # Numeric, Choice and Outline items of topic 'moe'
