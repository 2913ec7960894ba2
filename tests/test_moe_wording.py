"""Issue 32's corrections to chapter 10 stay corrected: the notebook, the engine's MoE
docstrings and the drill bank no longer carry the old claims, and the numbers they now state
come from the engine's tables."""

from __future__ import annotations

import json
from pathlib import Path

from engine.theory import hardware
from engine.drill import BANK

ROOT = Path(__file__).resolve().parents[1]
OLD_CLAIMS = (
    "so that every rank knows the shapes in advance",  # the dispatch exchanges counts anyway
    "smallest, $\\alpha$, when both are uniform",  # the Switch loss is a heuristic
    "smallest, ``alpha``, when both are uniform",
    "is alpha at perfect balance and grows with imbalance",
    "10-20x slower",  # NVLink against 400G InfiniBand is about 9x
    "InfiniBand, 25 GB/s per GPU",  # chapter 09 and engine.theory.hardware: 50 GB/s for 400G
    "grows more than 10x when",
)


def _texts() -> dict[str, str]:
    nb = json.loads((ROOT / "course/10_moe.ipynb").read_text())
    texts = {"course/10_moe.ipynb": "\n".join("".join(c["source"]) for c in nb["cells"])}
    for path in sorted((ROOT / "engine/moe").glob("*.py")):
        texts[str(path.relative_to(ROOT))] = path.read_text()
    texts["the drill bank"] = "\n".join(repr(item) for item in BANK)
    return texts


def test_the_old_moe_claims_are_gone():
    for where, text in _texts().items():
        for claim in OLD_CLAIMS:
            assert claim not in text, f"{where} still says {claim!r}"


def test_the_node_ratio_the_chapter_states_is_the_hardware_tables():
    h100 = hardware.GPU_SPECS["NVIDIA H100 80GB HBM3"]
    assert (h100.nvlink_gbps, h100.network_gbps) == (450, 50)  # 9x, as the chapter says
    nb = _texts()["course/10_moe.ipynb"]
    assert "450 GB/s and its one 400G InfiniBand NIC per GPU 50 GB/s:\n9x" in nb
    item = next(i for i in BANK if i.item_id == "moe-ep-inside-node")
    assert "about 9x less bandwidth" in item.options[item.answer]
