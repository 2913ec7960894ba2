"""python -m engine train: runs on CPU ranks, prints a report that teaches, refuses bad layouts,
obeys NCCL's rules, and prints once under torchrun."""

from __future__ import annotations

import contextlib
import io
import os
import re

import pytest
import torch
import torch.distributed as dist

from engine import launch
from engine.__main__ import main as engine_main


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def _rank_lines(out: str, heading: str) -> list[str]:
    """The per-rank lines of the block that starts with ``heading``."""
    lines = []
    for line in out.split(heading, 1)[1].split("\n")[1:]:
        if not line.startswith("    rank "):
            return lines
        lines.append(line)
    return lines


def test_the_report_of_a_dp2_tp2_run_teaches(capsys):
    assert engine_main(["train", "--world-size", "4", "--dp", "2", "--tp", "2",
                        "--steps", "4"]) == 0
    out = capsys.readouterr().out
    # the resolved configuration: chosen values plain, the others marked; no schedule at pp 1
    config = next(line for line in out.splitlines() if line.startswith("configuration:"))
    assert "--dp 2 " in config and "--tp 2 " in config and "--steps 4 " in config
    assert "--pp 1 (default)" in config and "--zero 1 (default)" in config
    assert "--precision auto -> fp32 (default)" in config
    assert "--backend auto -> gloo (default)" in config
    assert "schedule" not in config
    # the batch, so tokens/s can be checked by hand
    assert "sequence length 16 tokens; micro-batch 4 sequences; 2 micro-batches per step; " \
           "global batch dp 2 x 2 x 4 = 16 sequences = 256 tokens per step" in out
    # a loss for the warm-up step and each timed step, going down (each step a fresh global
    # batch of engine.compose.data's learnable language)
    losses = [float(x) for x in re.search(r"loss per step[^:]*: (.*)", out).group(1)
              .replace(" (warm-up)", "").split(", ")]
    assert len(losses) == 4 and losses[-1] < losses[0]
    # the step time is named for what it is
    median, low, high = map(float, re.search(r"step time: median ([\d.]+) ms, min ([\d.]+) "
                                             r"ms, max ([\d.]+) ms over 3 timed step", out)
                            .groups())
    assert low <= median <= high
    tokens_per_s = float(re.search(r"([\d,]+) tokens/s", out).group(1).replace(",", ""))
    assert tokens_per_s == pytest.approx(256 / (median / 1e3), rel=0.01)
    # bytes per rank split by group, each equal to its formula (counted on the wire)
    assert "counted on the wire" in out
    traffic = _rank_lines(out, "bytes sent per step")
    assert len(traffic) == 4
    for line in traffic:
        groups = dict((kind, (_number(sent), _number(formula))) for kind, sent, formula in
                      re.findall(r"(\w+) ([\d,]+) B = ([\d,]+) B", line))
        assert set(groups) == {"dp", "tp"}
        for kind, (sent, formula) in groups.items():
            assert sent == formula > 0, (kind, line)
    assert "dp: 1 step x ZeRO-1 over N = 2" in out and "tp: 1 step x m x (8bsh(t-1)/t" in out
    # memory per rank beside its formula: exact, but for AdamW's 4-byte step counter
    memory = _rank_lines(out, "model states per rank")
    assert len(memory) == 4
    for line in memory:
        fields = {name: (_number(held), _number(formula)) for name, held, formula in
                  re.findall(r"(params|grads|optimizer) ([\d,]+) B = ([\d,]+) B", line)}
        assert fields["params"][0] == fields["params"][1]
        assert fields["grads"][0] == fields["grads"][1]
        held, formula = fields["optimizer"]
        assert formula == fields["params"][1] * 2 / 2  # 8 B/param / dp 2, params 4 B/param
        assert held - formula == 4
    assert "optimizer 8 B/param (AdamW's two moments) under ZeRO-1, optimizer ÷ dp" in out
    assert "computing" in out and "MFU n/a: a CPU run" in out


def test_pipeline_report_explains_the_bubble_and_writes_a_trace(capsys, tmp_path):
    """The pipeline's idle share of the last step, measured from the runtime's F and B events
    (the composed loop keeps its PipelineRun), beside the simulator and the formula; the bytes
    are the pipeline group's, each beside its formula; the trace has every F and B."""
    import json

    trace = tmp_path / "trace.json"
    assert engine_main(["train", "--world-size", "2", "--pp", "2", "--steps", "1",
                        "--schedule", "gpipe", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "--schedule gpipe " in out
    line = next(x for x in out.splitlines() if "pipeline idle" in x)
    measured, simulated = map(float, re.search(
        r"pipeline idle ([\d.]+)% \(measured, last step\) vs ([\d.]+)% \(simulator fed the "
        r"measured stage times\) vs 33.3% \(formula", line).groups())
    assert 0 < simulated < 100 and 0 < measured < 100
    assert "the formula assumes equal stages and free hand-offs" in line
    lines = _rank_lines(out, "bytes sent per step")  # 2 micro-batches of 4 x 16 x 32 (fp32)
    # + the tied embedding's all-reduce 8,192 B; rank 0: + a 72 B shape header; rank 1
    # (the loss's stage): + the loss broadcast, 4 B
    for line, pp in zip(lines, ["24,648", "24,580"], strict=True):
        assert re.search(rf"pp {pp} B = {pp} B", line), line
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e.get("ph") == "X" for e in events) == 2 * 2 * 2  # 2 ranks x (2 F + 2 B)


@pytest.mark.parametrize("layout", [["--zero", "1"], ["--zero", "3", "--varlen"]])
def test_engine_and_torch_side_by_side(layout, capsys):
    """The same GPT, the same global batch of each step, the same global-token loss: PyTorch's
    DDP + ZeroRedundancyOptimizer (FSDP FULL_SHARD with --zero 3) prints the engine's loss at
    every step. The first step's (the same initial weights, the same batch) are the same
    digits; later steps follow updates whose gradients were reduced in another order (DDP's
    buckets, FSDP's reduce-scatter): equal within 1e-6, the fp32 bound of the parity matrix."""
    assert engine_main(["train", "--world-size", "2", "--dp", "2", *layout, "--impl", "both",
                        "--steps", "3", "--peak-tflops", "1"]) == 0
    out = capsys.readouterr().out
    assert "[engine]" in out and "[torch]" in out and "engine / torch tokens/s" in out
    assert "MFU" in out and "n/a" not in out
    engine, torch_side = (re.findall(r"\d\.\d{7}", line)
                          for line in re.findall(r"loss per step[^:]*: (.*)", out))
    assert len(engine) == len(torch_side) == 3
    assert engine[0] == torch_side[0]  # same model, same batch
    assert max(abs(float(a) - float(b)) for a, b in zip(engine, torch_side)) <= 1e-6


def _sent(out: str) -> int:
    """Bytes rank 0 sent per step through the data-parallel group, from the report."""
    return _number(re.search(r"rank 0 \(.*?\): dp ([\d,]+) B", out).group(1))


def test_compressed_data_parallel_sends_what_the_compressor_keeps(capsys):
    common = ["train", "--world-size", "2", "--dp", "2", "--zero", "0", "--steps", "2"]
    assert engine_main(common) == 0
    dense = _sent(capsys.readouterr().out)
    assert engine_main(common + ["--compress", "topk:0.01"]) == 0
    out = capsys.readouterr().out
    assert "[engine] composed engine: dp2 topk:0.01" in out
    # dense: a ring all-reduce sends 2(N-1)/N S = S at N = 2. Top-K: all-gathers of k fp32
    # values and k int32 indices, (N-1)/N x N x 4k bytes each = 8k = 2% of S (k = 1%)
    assert _sent(out) == pytest.approx(0.02 * dense, rel=0.05)


def test_compression_side_by_side_with_pytorchs_fp16_hook(capsys):
    assert engine_main(["train", "--world-size", "2", "--dp", "2", "--zero", "0", "--steps",
                        "2", "--compress", "fp16", "--impl", "both"]) == 0
    out = capsys.readouterr().out
    assert "[engine]" in out and "[torch]" in out and "engine / torch tokens/s" in out


@pytest.mark.parametrize("args, message", [
    (["--world-size", "4", "--dp", "2"], "dp x cp x tp x pp = 2 x 1 x 1 x 1 = 2 does not "
                                         "match the world size 4"),
    (["--world-size", "1", "--ep", "2", "--model", "tiny-moe"],
     "--ep 2 must divide dp x cp = 1 x 1: expert parallelism borrows its ranks from "
     "data/context parallelism; give --dp 2"),
    (["--world-size", "2", "--tp", "2", "--impl", "torch"], "--impl torch compares "
                                                            "data-parallel"),
    (["--world-size", "4", "--pp", "4", "--microbatches", "4"],
     "pp = 4 pipeline stages need at least 4 layers, the model has 2"),
    (["--world-size", "3", "--tp", "3"], "tp = 3 must divide heads = 4"),
    (["--world-size", "1", "--model", "huge"], "argument --model: invalid choice: 'huge' "
                                               "(choose from 'tiny', 'small', 'medium', "
                                               "'tiny-moe', 'llama-tiny', 'gpt2-124m', "
                                               "'llama3-1b', 'llama3-8b')"),
    (["--world-size", "2", "--dp", "2", "--compress", "fp16"], "--compress fp16 compresses "
                                                               "the gradients' all-reduce over "
                                                               "dp x cp: it needs --zero 0 "
                                                               "(ZeRO-1 to 3 reduce-scatter), "
                                                               "got --zero 1"),
    (["--world-size", "2", "--dp", "2", "--zero", "0", "--compress", "zip"],
     "unknown compressor spec 'zip'"),
    (["--world-size", "2", "--dp", "2", "--zero", "0", "--compress", "topk:0.01", "--impl",
      "both"], "PyTorch has no DDP hook for Top-K"),
    (["--world-size", "2", "--dp", "2", "--zero", "0", "--compress", "powersgd:2", "--impl",
      "torch"], "powerSGD_hook desynchronised the ranks"),
    (["--dp", "0"], "--dp must be a positive int, got 0"),
    (["--peak-tflops", "-5"], "--peak-tflops must be a positive number, got -5.0"),
])
def test_bad_layouts_are_refused_before_any_rank_starts(args, message, capsys):
    assert engine_main(["train", *args]) == 2
    assert message in capsys.readouterr().err


def _help_entries(text: str) -> dict[str, str]:
    """``{flag: its help entry, on one line}`` from argparse's ``--help``."""
    entries, flag = {}, None
    for line in text.split("options:", 1)[1].splitlines():
        start = re.match(r"  (--[\w-]+)", line)
        if start:
            flag = start.group(1)
            entries[flag] = line
        elif flag:
            entries[flag] += " " + line.strip()
    return entries


def test_help_gives_every_flag_its_text_choices_and_default(capsys):
    from engine.train.cli import parser

    with pytest.raises(SystemExit) as exit_:
        engine_main(["train", "--help"])
    assert exit_.value.code == 0
    entries = _help_entries(capsys.readouterr().out)
    options = [a for a in parser()._actions if "--help" not in a.option_strings]
    # 27 + --cp, --cp-method, --sequence-parallel, --varlen, --async-save,
    # --allow-oversubscribe, --resume-fallback (--composed, once its choice, is gone), --data,
    # --vocab, --attention, --dry-run, --compile
    assert len(options) == len(entries) == 39
    for action in options:
        flag = action.option_strings[0]
        entry = entries[flag]
        assert len(entry.split(")", 1)[0]) > 30 and "(default: " in entry, entry
        if action.default is not None:
            assert f"(default: {action.default})" in entry, entry
        for choice in action.choices or ():
            assert str(choice) in entry, (flag, choice)
    assert entries["--zero"].startswith("  --zero {0,1,2,3} ")
    assert entries["--model"].startswith(
        "  --model {tiny,small,medium,tiny-moe,llama-tiny,gpt2-124m,llama3-1b,llama3-8b}")
    assert entries["--attention"].startswith("  --attention {written,fast} ")
    assert entries["--impl"].startswith("  --impl {engine,torch,both} ")
    # every registered schedule: the composed engine runs each, the per-layout trainer two
    assert entries["--schedule"].startswith(
        "  --schedule {gpipe,1f1b,interleaved,zb_h1,zb_h2,zb_v,dualpipe_v} ")
    assert entries["--precision"].startswith("  --precision {auto,fp32,bf16} ")
    assert entries["--backend"].startswith("  --backend {auto,gloo,nccl} ")


def test_gpu_lab_cells_check_their_configuration_and_print_the_commands_on_a_cpu(capsys):
    from engine.train.cli import run_on_gpus

    args = ["--world-size", "2", "--dp", "2", "--zero", "3", "--impl", "both"]
    assert run_on_gpus(args, gpus_needed=10**6) is None
    out = capsys.readouterr().out
    assert "python -m engine train --world-size 2 --dp 2 --zero 3 --impl both --backend nccl" \
        in out
    assert "torchrun --nproc-per-node 1000000 -m engine train --dp 2 --zero 3" in out
    with pytest.raises(ValueError, match="does not match the world size 4"):
        run_on_gpus(["--world-size", "4", "--dp", "2"], gpus_needed=10**6)


# -- MFU: the peak of the precision trained, on the device trained on ---------------------------


def test_peak_table_is_keyed_by_the_exact_gpu_name_and_precision():
    from engine.train.report import peak_flops

    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12  # SXM
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops("NVIDIA H100 NVL", "bf16") == 835e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp32") == 67e12
    assert peak_flops("NVIDIA H100", "bf16") is None  # no guessing from a substring
    assert peak_flops("CPU", "fp32") is None
    assert peak_flops("CPU", "fp32", override_tflops=2.5) == 2.5e12


def test_the_trainer_reads_the_pipeline_layer_s_header_size():
    """The report's per-message header is derived from the pipeline link's own shape message
    (its rank and up to 8 sizes, int64), not copied."""
    from engine.pp.link import SHAPE_HEADER_BYTES

    assert SHAPE_HEADER_BYTES == 72


def test_a_cpu_run_on_a_gpu_machine_reports_no_gpu_mfu(capsys, monkeypatch):
    # a machine whose GPU is an H100 (as torch would report it); the run is on the CPU (Gloo)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    assert engine_main(["train", "--world-size", "1", "--steps", "1", "--backend",
                        "gloo"]) == 0
    out = capsys.readouterr().out
    assert "CPU, fp32" in out and "MFU n/a: a CPU run" in out


# -- NCCL's rules and torchrun, checked on CPU ranks --------------------------------------------

def _under_nccl_rules(rank, world_size, fn, cfg):
    """``fn`` inside ``nccl_rules()``: engine.comm.ops and torch.distributed's own collectives
    refuse what NCCL would."""
    from engine.observe.nccl_rules import nccl_rules

    with nccl_rules():
        return fn(rank, world_size, cfg)


@pytest.mark.parametrize("layout", [dict(dp=2, tp=2), dict(pp=2),
                                    dict(dp=2, zero=0, impl="both", compress="fp16")])
def test_every_tensor_the_trainer_hands_a_collective_is_on_the_rank_device(layout):
    from engine.train.cli import TrainConfig
    from engine.train.run import train_on_rank

    cfg = TrainConfig(steps=1, **layout)
    results = launch(_under_nccl_rules, cfg.world_size, train_on_rank, cfg, backend="gloo",
                     timeout=60, quiet=True)
    assert all(len(r["engine"]["step_s"]) == 1 for r in results)


def test_the_rules_catch_a_step_time_made_without_a_device():
    """The check above would have caught the trainer's first NCCL bug: a step time built on
    the CPU and all-reduced."""
    from engine.launch import RankError

    def old_step_time(rank, world_size, cfg):
        elapsed = torch.tensor([0.1], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)

    with pytest.raises(RankError, match="made without a device at .*test_train.py"):
        launch(_under_nccl_rules, 2, old_step_time, None, backend="gloo", timeout=60,
               quiet=True)


def _torchrun_agent(rank, world_size, argv):
    """One process as torchrun starts it: RANK and WORLD_SIZE set, no process group yet
    (the agent hosts the store), ``python -m engine train ARGV``; what it printed."""
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    dist.destroy_process_group()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = engine_main(["train", *argv])
    return code, out.getvalue()


def test_under_torchrun_only_global_rank_0_reports_and_writes_the_trace(tmp_path,
                                                                         monkeypatch):
    # torchrun's agent hosts the store its workers join (MASTER_ADDR/PORT); engine.launch's
    # ranks meet through a private FileStore, so the agent's store is hosted here, on loopback
    agent_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent_store.port))
    trace = tmp_path / "trace.json"
    results = launch(_torchrun_agent, 2, ["--dp", "2", "--steps", "1", "--trace", str(trace)],
                     backend="gloo", timeout=60, quiet=True)
    assert [code for code, _ in results] == [0, 0]
    printed = [out for _, out in results]
    assert printed[0].count("tokens/s") == 1 and "Chrome trace" in printed[0]
    assert printed[1] == ""
    assert trace.exists()


def test_a_compute_share_gap_between_identical_ranks_is_noted_only_beyond_the_noise(capsys):
    from engine.topology import Coordinates
    from engine.train.report import _compute_share_note

    def runs(*compute_per_rank):
        return [{"coords": Coordinates(dp=rank, tp=0, pp=0), "device_type": "cpu",
                 "step_s": [1.0, 1.0, 1.0], "compute_s": compute}
                for rank, compute in enumerate(compute_per_rank)]

    _compute_share_note(runs([0.90, 0.91, 0.90], [0.60, 0.61, 0.60]))
    note = capsys.readouterr().out
    assert "ranks 0 and 1 do the same work but computed 90% and 60% of the step" in note
    assert "noise (1%)" in note
    _compute_share_note(runs([0.90, 0.50, 0.90], [0.60, 0.61, 0.95]))  # a 45-point range
    assert capsys.readouterr().out == ""
