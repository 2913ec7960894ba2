"""Issue 42, items 1-10: chapters 07 and 11 true to their sources and to their own numbers.

The old wordings are gone from the notebooks, the drill bank and the engine's docstrings (each
pattern is the old wording, and a comment says what replaced it; whitespace is normalised, so a
pattern may span a line break); the corrections are there; and where a number is involved, the
engine or the notebook's own cells produce it: the DiLoCo cells of chapter 11 run here and every
loss the prose quotes is the one they print."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CH07 = ROOT / "course" / "07_3d_parallelism.ipynb"
CH11 = ROOT / "course" / "11_slow_links.ipynb"
SOURCES = [CH07, CH11, *sorted((ROOT / "engine" / "drill").glob("*.py")),
           *sorted((ROOT / "engine" / "ft").glob("*.py")),
           *sorted((ROOT / "engine" / "theory").glob("*.py")),
           *sorted((ROOT / "engine" / "labs").glob("*.py")), ROOT / "engine" / "zero" / "hsdp.py",
           ROOT / "engine" / "compose" / "parallelize.py", ROOT / "README.md"]

OLD = [
    # 1: the run's model has no q/k/v bias; now: SGD's step is the gradient's size, the bias was
    # removed because Adam magnifies round-off, the parity matrix's AdamW at lr 1e-4 and SGD rows
    "momentum SGD, not Adam, for a reason worth knowing",
    "momentum SGD keeps them at round-off size",
    # 2: torchtitan splits the pipeline first, CP is a runtime context; only "DP last" is forced
    "`parallelize_llama` has the same shape",
    "The order is torchtitan's",
    "tensor parallelism first** because",
    "after every step that rewrites modules inside a block",
    # 3: torchft is cited as its repository, pytorch/torchft (Liang et al. wrote TorchTitan)
    "Liang et al",
    # 4: HSDP is the FSDP paper's section 3.2.2
    "VLDB 2023, section 3.2.3",
    "(VLDB 2023), section 3.2.3",
    "section 3.2.3 (``HYBRID_SHARD``)",
    # 5: PyTorch's SHARD_GRAD_OP family gathers before forward and frees after backward; only
    # this engine's variant keeps the parameters whole
    "`_HYBRID_SHARD_ZERO2`) keeps the parameters whole",
    "``ShardingStrategy._HYBRID_SHARD_ZERO2``): the parameters stay whole",
    # 6: Ψ counts elements: 2(n-1)/n · Ψ · b bytes
    "about $2\\Psi$ bytes per replica",
    # 7: the final losses beside the untrained model's; the paper's outer lr at H = 100 ends
    # worse than untrained on the MLP, a tuned one trains; "it trains" points at the GPT table
    "The loss at equal tokens is the price, and on a run this short it is a real one",
    "At $H = 100$ the last sync lands on step 200, at the top of such a spike",
    "trails it at equal tokens on short runs, but it trains. For failures",
    "not DDP for H > 1: it trains, behind DDP at equal tokens on short runs; the",
    "The same story as the MLP's",
    # 8: a Manager computes a quorum each step, reconfigures only when the quorum changes
    "reconfigures its process group each step",
    # 10: the kill comes just before the all-reduce; engine.ft reduces inside, then slices
    "killed in the middle of an all-reduce",
    "Inside a group the gradient is reduce-scattered; each rank",
]


def _text(path: Path) -> str:
    if path.suffix == ".ipynb":
        text = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"])
    else:
        text = path.read_text()
    return " ".join(text.split())


def _cell(path: Path, cell_id: str) -> str:
    cells = json.loads(path.read_text())["cells"]
    return "".join(next(c for c in cells if c.get("id") == cell_id)["source"])


@pytest.mark.parametrize("wording", OLD)
def test_the_old_chapter_07_and_11_wordings_are_gone(wording):
    found = [p.relative_to(ROOT).as_posix() for p in SOURCES if wording in _text(p)]
    assert not found, f"{wording!r} still in {found}"


CORRECTIONS = {
    CH07: ["no bias on q, k and v", "at lr 1e-4", "runs again with plain SGD",
           "**the data-parallel wrapper comes last**", "`pipeline_llama`", "(`context_parallel`)"],
    CH11: ["section 3.2.2", "$2M(W-1)/(GW)$", "`SHARD_GRAD_OP`", "frees them after it",
           "in this engine's variant the parameters stay whole", "$2(n-1)/n \\cdot \\Psi \\cdot b$",
           "`pytorch/torchft`", "only when the quorum changes", "*strided* fragments",
           "the untrained model's 1.02", "the untrained model's 4.1486", "(the GPT table)",
           "Why the outer step overshoots here"],
    ROOT / "engine" / "theory" / "slow_links.py": ["section 3.2.2", "2M(W-1)/(GW)"],
    ROOT / "engine" / "zero" / "hsdp.py": ["section 3.2.2", "SHARD_GRAD_OP", "2M(W-1)/(GW)"],
    ROOT / "engine" / "ft" / "diloco.py": ["*strided* fragments"],
    ROOT / "engine" / "labs" / "diloco.py": ["strided fragments"],
    ROOT / "engine" / "ft" / "__init__.py": ["github.com/pytorch/torchft"],
    ROOT / "engine" / "compose" / "parallelize.py": ["Only the last place is forced",
                                                    "``context_parallel``"],
    ROOT / "engine" / "drill" / "slow_links.py": ["just before the gradient all-reduce",
                                                   "ends far below the untrained"],
}


@pytest.mark.parametrize("path", list(CORRECTIONS), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_corrections_are_there(path):
    text = _text(path)
    for correct in CORRECTIONS[path]:
        assert correct in text, correct


# -- the facts the corrections state, from the engine and its sources ---------------------------

def test_chapter_07s_run_has_no_qkv_bias_and_the_parity_matrix_runs_adamw_at_1e_4_and_sgd():
    from engine.compose.parity import LR, OPTIMIZERS, TOLERANCE
    from engine.labs.hybrid import model_of
    from engine.model.gpt import GPTConfig

    assert model_of(GPTConfig(vocab=64, seq_len=16, layers=2, heads=4, hidden=32)).qkv_bias is False
    assert LR == 1e-4 and TOLERANCE == 1e-6 and set(OPTIMIZERS) == {"adamw", "sgd"}


def test_the_fsdp_papers_cross_host_bytes_bound_the_ring_over_the_replicas():
    """2(R-1)/R · Ψ/S · b = 2M(W-S)/(SW) <= the paper's 2M(W-1)/(GW), G = S, W = RS, M = Ψb;
    equal in the limit of many replicas. The chapter's 4 ranks print 8448 against 12,672."""
    from engine import theory

    for numel, shard, replicas in ((4224, 2, 2), (10**6, 8, 4), (10**6, 8, 512)):
        m, w = numel * 4, shard * replicas
        ring = theory.hsdp_replica_bytes(numel, shard, replicas, 4)
        assert ring == pytest.approx(2 * m * (w - shard) / (shard * w))
        assert ring <= 2 * m * (w - 1) / (shard * w)
    assert theory.hsdp_replica_bytes(4224, 2, 2) == 8448 and 2 * 4224 * 4 * 3 / (2 * 4) == 12672
    assert 2 * 10**6 * 4 * (8 * 512 - 1) / (8 * 8 * 512) / theory.hsdp_replica_bytes(
        10**6, 8, 512) < 1.003


def test_torchfts_manager_reconfigures_only_when_the_quorum_id_changes():
    manager = pytest.importorskip("torchft.manager", reason="torchft (the extra 'ft') is not "
                                  "installed beside this torch")
    source = inspect.getsource(manager.Manager._async_quorum)
    assert "if quorum_id != self._quorum_id:" in source
    assert source.index("if quorum_id != self._quorum_id:") < source.index("self._pg.configure(")


def test_the_drill_states_the_kill_point_and_the_inner_reduction():
    import random

    from engine import theory
    from engine.drill.slow_links import CHOICES, ITEMS

    survivors = next(c for c in CHOICES if c.item_id == "ft-survivors")
    assert "just before the gradient all-reduce" in survivors.text
    cross = next(i for i in ITEMS if i.item_id == "ft-cross-bytes")
    for seed in range(5):
        q = cross.draw(random.Random(seed))
        assert "reduces its gradient inside (HSDP's shape, as engine.ft does)" in q.text
        total, g, millions = (int(x) for x in re.search(
            r"(\d+) replica groups of (\d+) ranks train a (\d+)M", q.text).groups())
        assert f"each of its G = {g} ranks holds a 1/G slice" in q.text
        assert q.answer == theory.hsdp_replica_bytes(millions * 1e6, g, total - 1, 4) / 1e6


# -- chapter 11's DiLoCo numbers: the notebook's cells, run here -----------------------------

QUOTED = {  # the number the prose of cell ch11-08 quotes -> how to read it from the cells' results
    "1.02": lambda g: g["START"],
    "0.14": lambda g: g["results"]["DDP"]["curve"][-1],
    "0.19": lambda g: g["results"]["local SGD H=50 (outer lr 1, no momentum)"]["curve"][-1],
    "0.39": lambda g: g["results"]["DiLoCo H=100"]["before_sync"][0],
    "0.26": lambda g: g["results"]["DiLoCo H=100"]["before_sync"][1],
    "2.98": lambda g: g["results"]["DiLoCo H=100"]["curve"][-1],
    "0.31": lambda g: g["results"][g["TUNED"]]["curve"][-1],
    "0.56": lambda g: g["results"][g["SWEEP"][0.2]]["curve"][-1],
    "0.84": lambda g: g["results"][g["SWEEP"][0.4]]["curve"][-1],
}


@pytest.fixture(scope="module")
def diloco_cells():
    """Chapter 11's imports, the HSDP cell (it defines the MLP's sizes) and the DiLoCo cell,
    executed as the notebook executes them; their globals."""
    import matplotlib

    matplotlib.use("Agg")
    scope = {"__name__": "__chapter_11__"}
    for cell_id in ("ch11-01", "ch11-04", "ch11-07"):
        exec(compile(_cell(CH11, cell_id), f"{CH11.name}:{cell_id}", "exec"), scope)
    return scope


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_tuned_outer_lr_trains_where_the_papers_ends_worse_than_untrained(diloco_cells):
    g = diloco_cells
    start, results = g["START"], g["results"]
    paper, tuned = results["DiLoCo H=100"]["curve"][-1], results[g["TUNED"]]["curve"][-1]
    assert paper > start > tuned  # the paper's 0.7 / 0.9 ends worse than untrained; 0.3 trains
    assert g["TUNED_LR"] == 0.3
    assert all(tuned < results[name]["curve"][-1] for name in g["SWEEP"].values())  # the best
    assert all(r["start"] == start for r in results.values())  # one start for every run
    h100 = results["DiLoCo H=100"]["before_sync"]
    assert len(h100) == 2 and all(x < start for x in h100)  # the replicas trained before syncing
    for name in ("DiLoCo H=10", "DiLoCo H=50", "local SGD H=50 (outer lr 1, no momentum)"):
        assert results[name]["curve"][-1] < start  # these do train at the paper's settings


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_loss_the_diloco_prose_quotes_is_one_the_cell_prints(diloco_cells):
    prose = " ".join(_cell(CH11, "ch11-08").split())
    for quoted, read in QUOTED.items():
        assert quoted in prose, quoted
        assert f"{read(diloco_cells):.2f}" == quoted, (quoted, read(diloco_cells))


def test_the_gpt_tables_start_is_the_untrained_models_loss_and_every_run_ends_below_it():
    from engine.labs.diloco import CONFIG, _held_out_loss
    from engine.model.gpt import TinyGPT

    start = _held_out_loss(TinyGPT(CONFIG, seed=0))
    table = _cell(CH11, "ch11-diloco-gpt")
    assert f"| untrained model (every run's start) | {start:.4f} |" in table
    finals = [float(x) for x in re.findall(r"^\| [^|]*(?:DDP|DiLoCo)[^|]* \| ([\d.]+) \|", table,
                                           flags=re.M)]
    assert len(finals) == 5 and all(f < start - 0.5 for f in finals)
