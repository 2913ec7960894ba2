"""``python -m engine train`` on the composed engine (engine.train.composed): every layout trains
on the same global batch of step k as one process, and its loss per step (the mean over every
non-padding token of the global batch) equals one process's within 1e-6; what the composed
engine cannot carry is refused before any rank starts, naming the flags."""

from __future__ import annotations

import re

import pytest

from engine.__main__ import main as engine_main
from engine.compose.parity import Row, run_row
from engine.compose.plan import Plan

TOLERANCE = 1e-6
STEPS = ["--steps", "3"]


def _losses(out: str) -> list[float]:
    line = next(line for line in out.splitlines() if line.startswith("  loss per step ("))
    assert "(mean over every non-padding token of the global batch)" in line, line
    return [float(x) for x in re.findall(r"\d+\.\d+", line.split(":", 1)[1])]


def _run(args: list[str], capsys) -> list[float]:
    assert engine_main(["train", *args, *STEPS]) == 0
    return _losses(capsys.readouterr().out)


# each layout and the one-process run of the same global batch (dp x microbatches x
# micro-batch sequences: 8)
ACCEPTANCE = {
    "cp2 x tp2": (["--cp", "2", "--tp", "2", "--microbatches", "2", "--micro-batch", "4"],
                  ["--world-size", "1", "--microbatches", "2",
                   "--micro-batch", "4"]),
    "dp2 x tp2 ZeRO-3": (["--dp", "2", "--tp", "2", "--zero", "3",
                          "--microbatches", "2", "--micro-batch", "2"],
                         ["--world-size", "1", "--microbatches", "2",
                          "--micro-batch", "4"]),
    "dp2 x pp2 ZeRO-3": (["--dp", "2", "--pp", "2", "--zero", "3",
                          "--microbatches", "2", "--micro-batch", "2"],
                         ["--world-size", "1", "--microbatches", "2",
                          "--micro-batch", "4"]),
    "varlen dp2 x pp2": (["--varlen", "--dp", "2", "--pp", "2", "--microbatches", "2",
                          "--micro-batch", "2"],
                         ["--varlen", "--world-size", "1", "--microbatches", "2",
                          "--micro-batch", "4"]),
    # MoE (dropless, no router losses: engine.train.composed) with ep borrowed from dp
    "tiny-moe ep2 x pp2": (["--model", "tiny-moe", "--dp", "2", "--ep", "2",
                            "--pp", "2", "--microbatches", "2", "--micro-batch", "2"],
                           ["--model", "tiny-moe", "--world-size", "1",
                            "--microbatches", "2", "--micro-batch", "4"]),
    # Megatron-Core's MoE layout: experts spread over the data-parallel ranks, the dense parts
    # tensor-parallel with sequence parallelism (MoE layers on the gathered sequence)
    "tiny-moe ep2 x tp2 sp": (["--model", "tiny-moe", "--dp", "2", "--ep", "2", "--tp", "2",
                               "--sequence-parallel", "--microbatches", "2",
                               "--micro-batch", "2"],
                              ["--model", "tiny-moe", "--world-size", "1",
                               "--microbatches", "2", "--micro-batch", "4"]),
}


@pytest.mark.parametrize("name", ACCEPTANCE)
def test_every_layout_has_the_loss_of_one_process(name, capsys):
    layout, alone = ACCEPTANCE[name]
    parallel, reference = _run(layout, capsys), _run(alone, capsys)
    with capsys.disabled():
        print(f"\n{name}: {parallel}\none process: {reference}")
    assert len(parallel) == len(reference) == 3
    assert max(abs(a - b) for a, b in zip(parallel, reference)) <= TOLERANCE, \
        (parallel, reference)


@pytest.mark.parametrize("args, message", [
    (["--cp", "3"], "--cp 3"),
    (["--cp", "2", "--cp-method", "usp:2x2"], "U x R = 4 must equal cp = 2"),
    (["--cp", "4", "--cp-method", "usp:4x1", "--tp", "2"],
     "U (Ulysses gives each rank whole heads) = 4 must divide heads per tensor-parallel rank "
     "= 2"),
    (["--cp", "2", "--cp-method", "ulysses", "--tp", "4"], "Ulysses gives each rank whole "
                                                           "heads"),
    (["--world-size", "2", "--ep", "2", "--tp", "2", "--model", "tiny-moe"],
     "--ep 2 must divide dp x cp = 1 x 1"),
    (["--world-size", "4", "--dp", "2"], "dp x cp x tp x pp = 2 x 1 x 1 x 1 = "
                                                       "2 does not match the world size 4"),
    # --save covers every composed layout now (tests/test_compose_resume.py), and --reshard
    # every layout change (tests/test_compose_reshard.py; --compress: test_compose_resume.py)
    (["--cp", "2", "--compress", "fp16", "--zero", "1"],
     "--compress fp16 compresses the gradients' all-reduce over dp x cp: it needs --zero 0 "
     "(ZeRO-1 to 3 reduce-scatter), got --zero 1"),
    (["--cp", "2", "--compress", "zip", "--zero", "0"], "unknown compressor spec 'zip'"),
    (["--varlen", "--pp", "2", "--microbatches", "1"], "at least 2 micro-batches"),
])
def test_what_the_composed_engine_cannot_carry_is_refused_naming_the_flags(args, message,
                                                                          capsys):
    assert engine_main(["train", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("plan", [Plan(cp=2, cp_method="allgather"),
                                  Plan(cp=4, cp_method="usp:2x2")], ids=lambda p: p.name)
def test_allgather_and_usp_context_parallelism_train_as_one_process(plan):
    """All-gather CP (Llama 3) on 2 ranks, USP on 4 (Ulysses over 2 inside, ring over 2
    across): the parity matrix's model, 3 AdamW steps, losses and every parameter within 1e-6
    of one process (another order of the sums)."""
    result = run_row(Row(plan))
    assert result.loss_diff <= TOLERANCE and result.param_diff <= TOLERANCE, result


def test_engine_train_runs_usp(capsys):
    """--cp 4 --cp-method usp:2x2: the loss of one process, and the bytes over cp counted
    beside USP's formula (theory.usp_bytes), within 2 B a rank: the step's loss, one float
    all-reduced over 4 ranks, sends 4 or 8 B by rank where the formula counts the mean, 6 B."""
    alone = _run(["--world-size", "1", "--microbatches", "2"], capsys)
    assert engine_main(["train", "--cp", "4", "--cp-method", "usp:2x2", "--microbatches", "2",
                        *STEPS]) == 0
    out = capsys.readouterr().out
    usp = _losses(out)
    assert len(usp) == 3 and max(abs(a - b) for a, b in zip(usp, alone)) <= TOLERANCE
    assert "USP: Ulysses over U = 2 + ring over R = 2 (theory.usp_bytes)" in out
    traffic = out.split("bytes sent per step", 1)[1]
    for line in [line for line in traffic.splitlines() if line.startswith("    rank ")][:4]:
        counted, formula = (int(x.replace(",", "")) for x in
                            re.search(r"cp ([\d,]+) B = ([\d,]+) B", line).groups())
        assert abs(counted - formula) <= 2, line


def test_bytes_per_group_are_counted_beside_their_formulas(capsys):
    """cp2 x tp2: ring attention's K/V blocks and the gradients' all-reduce over cp, Megatron's
    all-reduces over tp (on S/cp tokens a rank), each counted on the wire equal to its
    formula; the ranks named by their cp index too."""
    assert engine_main(["train", "--cp", "2", "--tp", "2", *STEPS]) == 0
    out = capsys.readouterr().out
    traffic = out.split("bytes sent per step", 1)[1]
    ranks = [line for line in traffic.splitlines() if line.startswith("    rank ")][:4]
    assert [line.split("(")[1].split(",")[0] for line in ranks] == [
        "dp0 cp0 tp0 pp0", "dp0 cp0 tp1 pp0", "dp0 cp1 tp0 pp0", "dp0 cp1 tp1 pp0"]
    for line in ranks:
        cells = dict(re.findall(r"(cp|tp) ([\d,]+ B = [\d,]+ B)", line))
        assert set(cells) == {"cp", "tp"}, line
        for kind, cell in cells.items():
            counted, formula = cell.split(" = ")
            assert counted == formula, (kind, line)
    assert "ring attention: 3 x 2 (N-1) (S/N) kv_hidden x 4 B" in out


def test_zero3_with_tp_holds_and_sends_what_its_formulas_say(capsys):
    """dp2 x tp2 ZeRO-3 (FSDP + TP): the bytes over dp and tp equal their formulas, and each
    rank's parameters and gradients are ZeRO-3's 1/dp of its tensor-parallel part."""
    assert engine_main(["train", "--dp", "2", "--tp", "2", "--zero", "3",
                        *STEPS]) == 0
    out = capsys.readouterr().out
    traffic, memory = (out.split(heading, 1)[1] for heading in ("bytes sent per step",
                                                                "model states per rank"))
    ranks = [line for line in traffic.splitlines() if line.startswith("    rank ")][:4]
    for line in ranks:
        cells = dict(re.findall(r"(dp|tp) ([\d,]+ B = [\d,]+ B)", line))
        assert set(cells) == {"dp", "tp"} and all(
            a == b for a, b in (cell.split(" = ") for cell in cells.values())), line
    states = [line for line in memory.splitlines() if line.startswith("    rank ")][:4]
    for line in states:
        for field in ("params", "grads"):
            counted, formula = re.search(field + r" ([\d,]+ B) = ([\d,]+ B)", line).groups()
            assert counted == formula == "28,800 B", line  # 14,400 parameters / 2 x 4 B


def test_compressed_gradients_over_dp_send_what_the_compressor_keeps(capsys):
    """--compress on the composed engine: DDP's all-reduce over dp x cp through the
    compressor, its bytes counted equal to the compressor's formula."""
    assert engine_main(["train", "--dp", "2", "--zero", "0", "--compress",
                        "topk:0.1", *STEPS]) == 0
    out = capsys.readouterr().out
    assert "composed engine: dp2 topk:0.1" in out
    traffic = out.split("bytes sent per step", 1)[1]
    for line in [line for line in traffic.splitlines() if line.startswith("    rank ")][:2]:
        counted, formula = re.search(r"dp ([\d,]+ B) = ([\d,]+ B)", line).groups()
        assert counted == formula, line


def test_a_resumed_composed_run_is_bit_identical_to_an_uninterrupted_one(tmp_path, capsys):
    """cp2 x tp2 at ZeRO-0 (every rank its own state, engine.checkpoint.per_rank): 2 steps,
    then 2 more from the checkpoint, equal bit for bit to 4 steps in one go."""
    import json

    import torch

    from engine.checkpoint.per_rank import read_rank_state

    layout = ["--cp", "2", "--tp", "2", "--zero", "0"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert engine_main(["train", *layout, "--steps", "4", "--save", str(whole)]) == 0
    assert engine_main(["train", *layout, "--steps", "2", "--save", str(split)]) == 0
    assert engine_main(["train", *layout, "--steps", "4", "--save", str(split),
                        "--resume"]) == 0
    assert "resumed from" in capsys.readouterr().out
    final = {name: root / "step-00000004" for name, root in (("whole", whole),
                                                               ("split", split))}
    curves = {name: json.loads((path / "trainer.json").read_text())["losses"]
              for name, path in final.items()}
    assert curves["whole"] == curves["split"] and len(curves["whole"]) == 4
    for rank in range(4):
        a, b = (read_rank_state(final[name], rank) for name in ("whole", "split"))
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        # the composed rank's optimizer side (engine.compose.resume): its one AdamW's state
        a, b = (state["optimizer"]["optimizers"][0] for state in (a, b))
        assert a["state"].keys() == b["state"].keys()
        for key, state in a["state"].items():
            assert all(torch.equal(state[n], b["state"][key][n]) for n in state)


def test_what_the_composed_engine_cannot_save_or_resume_is_refused(tmp_path, capsys):
    assert engine_main(["train", "--cp", "2", "--zero", "0", "--steps", "2", "--save",
                        str(tmp_path)]) == 0
    capsys.readouterr()
    assert engine_main(["train", "--world-size", "2", "--dp", "2", "--zero", "0", "--steps",
                        "3", "--save", str(tmp_path), "--resume"]) == 2
    assert "the composed engine resumes its own checkpoints on their own layout only" in \
        capsys.readouterr().err
    # (--cp 2 --zero 1 --reshard, refused here before engine.compose.reshard, re-cuts now:
    # tests/test_compose_reshard.py)
