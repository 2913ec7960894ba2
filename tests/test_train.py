"""python -m engine train: runs on CPU ranks, prints the lab's numbers, refuses bad layouts."""

from __future__ import annotations

import re

import pytest

from engine.__main__ import main as engine_main


def test_train_on_four_cpu_ranks_prints_throughput(capsys):
    assert engine_main(["train", "--world-size", "4", "--dp", "2", "--tp", "2",
                        "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "step 3/3" in out
    assert out.count("rank dp") == 4 and "optimizer" in out and "activations" in out


def test_pipeline_run_reports_idle_time_and_writes_a_trace(capsys, tmp_path):
    import json

    trace = tmp_path / "trace.json"
    assert engine_main(["train", "--world-size", "2", "--pp", "2", "--steps", "1",
                        "--schedule", "gpipe", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "bubble formula 33.3%" in out
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e.get("ph") == "X" for e in events) == 2 * 2 * 2  # 2 ranks x (2 F + 2 B)


def test_engine_and_torch_side_by_side(capsys):
    assert engine_main(["train", "--world-size", "2", "--dp", "2", "--zero", "1", "--impl",
                        "both", "--steps", "2", "--peak-tflops", "1"]) == 0
    out = capsys.readouterr().out
    assert "[engine]" in out and "[torch]" in out and "engine / torch tokens/s" in out
    assert "MFU" in out and "n/a" not in out


def _sent(out: str) -> float:
    """Bytes rank dp0 sent per step, from the report."""
    value, unit = re.search(r"rank dp0 .*; sent ([\d.]+) (KB|MB)", out).groups()
    return float(value) * (1e3 if unit == "KB" else 1e6)


def test_compressed_data_parallel_sends_what_the_compressor_keeps(capsys):
    common = ["train", "--world-size", "2", "--dp", "2", "--zero", "0", "--steps", "2"]
    assert engine_main(common) == 0
    dense = _sent(capsys.readouterr().out)
    assert engine_main(common + ["--compress", "topk:0.01"]) == 0
    out = capsys.readouterr().out
    assert "gradients compressed with topk:0.01" in out
    # dense: a ring all-reduce sends 2(N-1)/N S = S at N = 2. Top-K: all-gathers of k fp32
    # values and k int32 indices, (N-1)/N x N x 4k bytes each = 8k = 2% of S (k = 1%)
    assert _sent(out) == pytest.approx(0.02 * dense, rel=0.05)


def test_compression_side_by_side_with_pytorchs_fp16_hook(capsys):
    assert engine_main(["train", "--world-size", "2", "--dp", "2", "--zero", "0", "--steps",
                        "2", "--compress", "fp16", "--impl", "both"]) == 0
    out = capsys.readouterr().out
    assert "[engine]" in out and "[torch]" in out and "engine / torch tokens/s" in out


@pytest.mark.parametrize("args, message", [
    (["--world-size", "4", "--dp", "2"], "dp x tp x pp = 2 x 1 x 1 = 2 does not match the "
                                         "world size 4"),
    (["--world-size", "2", "--tp", "2", "--zero", "3"], "--zero 3 runs here with data "
                                                         "parallelism only"),
    (["--world-size", "2", "--tp", "2", "--impl", "torch"], "--impl torch/both compares "
                                                            "data-parallel"),
    (["--world-size", "4", "--pp", "4"], "--pp 4 needs at least 4 layers"),
    (["--world-size", "3", "--tp", "3"], "hidden=32 is not divisible by the tensor-parallel "
                                          "degree 3"),
    (["--world-size", "1", "--model", "huge"], "--model must be one of tiny, small, medium"),
    (["--world-size", "2", "--dp", "2", "--compress", "fp16"], "--compress fp16 runs on data "
                                                               "parallelism without ZeRO"),
    (["--world-size", "2", "--dp", "2", "--zero", "0", "--compress", "zip"],
     "unknown compressor spec 'zip'"),
    (["--world-size", "2", "--dp", "2", "--zero", "0", "--compress", "topk:0.01", "--impl",
      "both"], "PyTorch has no DDP hook for Top-K"),
    (["--world-size", "2", "--dp", "2", "--zero", "0", "--compress", "powersgd:2", "--impl",
      "torch"], "powerSGD_hook desynchronised the ranks"),
])
def test_bad_layouts_are_refused_before_any_rank_starts(args, message, capsys):
    assert engine_main(["train", *args]) == 2
    assert message in capsys.readouterr().err


def test_gpu_lab_cells_check_their_configuration_and_print_the_commands_on_a_cpu(capsys):
    from engine.train import run_on_gpus

    args = ["--world-size", "2", "--dp", "2", "--zero", "3", "--impl", "both"]
    assert run_on_gpus(args, gpus_needed=10**6) is None
    out = capsys.readouterr().out
    assert "python -m engine train --world-size 2 --dp 2 --zero 3 --impl both --backend nccl" \
        in out
    assert "torchrun --nproc-per-node 1000000 -m engine train --dp 2 --zero 3" in out
    with pytest.raises(ValueError, match="does not match the world size 4"):
        run_on_gpus(["--world-size", "4", "--dp", "2"], gpus_needed=10**6)
