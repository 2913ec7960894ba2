"""Issue 32's corrections to chapter 06's zero-bubble claims stay corrected: DualPipeV is not
attributed to the DeepSeek-V3 report (which describes DualPipe), and zero bubble's price is not
"memory" for every schedule (on transformer layers ZB-H1 and ZB-V keep 1F1B's peak; ZB-V and
DualPipeV pay twice the messages; ZB-H2 pays memory)."""

from __future__ import annotations

import json
from pathlib import Path

from engine.drill.bank import BANK

ROOT = Path(__file__).resolve().parents[1]
OLD = ("the DeepSeek-V3 technical report; DualPipe \"cut in half\"",
       "DeepSeek-V3 technical report, 2024; deepseek-ai/DualPipe",
       "The price is memory, each micro-batch's layer inputs and output gradients kept",
       "Memory: each micro-batch keeps its layers' inputs and output gradients from B to W; and")


def _texts():
    nb = json.loads((ROOT / "course" / "06_pipeline.ipynb").read_text(encoding="utf-8"))
    yield "course/06_pipeline.ipynb", "\n".join("".join(c["source"]) for c in nb["cells"])
    yield "engine/pp/zero_bubble.py", (ROOT / "engine" / "pp" / "zero_bubble.py").read_text()
    for item in BANK:
        yield item.item_id, " ".join(str(getattr(item, f, "")) for f in
                                     ("text", "options", "explanation", "outline"))


def test_the_old_wordings_are_gone():
    for where, text in _texts():
        for old in OLD:
            assert old not in text, f"{where} still says {old!r}"


def test_zero_bubble_free_is_keyed_to_the_price_of_each_schedule():
    item = next(i for i in BANK if i.item_id == "zero-bubble-free")
    right = item.options[item.answer]
    for fact in ("ZB-H1 and ZB-V keep 1F1B's peak", "twice the point-to-point", "ZB-H2",
                 "2p-1"):
        assert fact in right
    wrong = [o for k, o in enumerate(item.options) if k != item.answer]
    assert any(o.startswith("Memory, every one of them") for o in wrong)
