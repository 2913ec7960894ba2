"""engine.theory.planner: only configurations that fit, ranked by the step-time model."""

from __future__ import annotations

import pytest

from engine import theory
from engine.theory.planner import MODELS, Cluster, memory_per_gpu, plan, step_time


@pytest.mark.parametrize("model, gpus, batch", [("GPT-3 175B", 1024, 1536),
                                                ("LLaMA 7B", 64, 512), ("GPT-2 1.5B", 8, 64)])
def test_every_plan_fits_and_respects_the_layout_rules(model, gpus, batch):
    spec, cluster = MODELS[model], Cluster(gpus)
    plans = plan(spec, cluster, batch)
    assert plans
    for p in plans:
        assert p.memory["total"] <= 0.9 * cluster.memory_gb * 1e9
        assert p.dp * p.tp * p.pp == gpus and p.tp <= 8
        assert spec.layers % p.pp == 0 and spec.heads % p.tp == 0
        assert p.dp * p.micro_batch * p.micro_batches == batch
    times = [p.time["total"] for p in plans]
    assert times == sorted(times)


def test_configurations_that_do_not_fit_are_never_proposed():
    spec = MODELS["GPT-3 175B"]
    # plain data parallelism: 16 bytes x 175 B parameters on every GPU, 2.8 TB
    assert memory_per_gpu(spec, 1024, 1, 1, 0, 1, 2)["total"] > 2.7e12
    plans = plan(spec, Cluster(1024), 1536)
    assert not any(p.tp == 1 and p.pp == 1 and p.zero < 3 for p in plans)
    assert plan(spec, Cluster(8, memory_gb=1), 64) == []


def test_memory_and_time_follow_the_formulas():
    spec = MODELS["LLaMA 7B"]
    memory = memory_per_gpu(spec, 8, 1, 1, 1, 1, 4, recompute=True)
    states = theory.zero_model_state_bytes(spec.params, 8, 1)
    assert memory["optimizer"] == states["optimizer"] and memory["params"] == states["params"]
    assert memory["activations"] == 32 * 2 * 2048 * 4096  # one micro-batch, 2sbh per layer
    cluster = Cluster(8)
    t = step_time(spec, cluster, 8, 1, 1, 1, 1, 32, mfu=0.5)
    flops = theory.transformer_flops(32, 2048, 32, 4096, 32000) / 8
    assert t["compute"] == pytest.approx(flops / (0.5 * 312e12))
    assert t["tp"] == t["pp"] == t["bubble"] == 0
    assert t["dp"] > 0


def test_bad_cluster_is_a_clear_error():
    with pytest.raises(ValueError, match="need gpus >= 1 and global_batch >= 1"):
        plan(MODELS["LLaMA 7B"], Cluster(0), 8)


def test_the_planner_and_the_trainers_report_read_one_gpu_table():
    """engine.theory.hardware holds the peaks and links once: the planner's GPUs and its default
    cluster, and the report's MFU peaks, are rows of it."""
    from engine.theory.hardware import GPU_SPECS, peak_flops
    from engine.theory.planner import GPUS

    for label, device in (("A100 80GB", "NVIDIA A100-SXM4-80GB"),
                          ("H100 80GB", "NVIDIA H100 80GB HBM3"), ("H200 141GB", "NVIDIA H200")):
        assert GPUS[label]["peak_tflops"] * 1e12 == peak_flops(device, "bf16")
        assert GPUS[label]["memory_gb"] == GPU_SPECS[device].memory_gb
    default = Cluster(8)
    assert (default.memory_gb, default.peak_tflops, default.intra_gbps, default.inter_gbps) == \
        (80, 312, 300, 25)
    assert Cluster(8, **GPUS["A100 80GB"]) == default
