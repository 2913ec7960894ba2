"""engine.planner: only configurations that fit, ranked by the step-time model."""

from __future__ import annotations

import pytest

from engine import theory
from engine.planner import MODELS, Cluster, memory_per_gpu, plan, step_time


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
