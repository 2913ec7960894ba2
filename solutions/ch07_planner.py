"""Reference for exercise ch07.planner (the engine's is engine/theory/planner.py)."""

from engine import theory
from engine.theory.planner import Cluster, ModelSpec, step_time

MICRO_BATCH_SIZES = (1, 2, 4, 8)
ZERO_STAGES = (0, 1, 2, 3)
RESERVE = 0.1  # a layout fits if it needs at most (1 - RESERVE) of a GPU's memory


def memory_per_gpu(model: ModelSpec, dp: int, tp: int, pp: int, zero: int, micro_batch: int,
                   micro_batches: int) -> float:
    """Model states of params / (tp pp) sharded by ZeRO over dp, plus the first stage's
    activations: min(pp, m) micro-batches of layers / pp layers."""
    states = theory.zero_model_state_bytes(model.params / (tp * pp), dp, zero)["total"]
    per_layer = theory.activation_bytes_per_layer(model.seq_len, micro_batch, model.hidden,
                                                  model.heads, tp, 1, False, True)
    return states + min(pp, micro_batches) * (model.layers / pp) * per_layer


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def fastest_layout(model: ModelSpec, cluster: Cluster, global_batch: int,
                   mfu: float = 0.5) -> tuple[int, int, int, int, int] | None:
    """Every valid layout that fits, ranked by (step time, memory); the first, or None."""
    budget = (1 - RESERVE) * cluster.memory_gb * 1e9
    best, best_key = None, None
    for tp in _divisors(cluster.gpus):
        if tp > cluster.gpus_per_node or model.heads % tp or model.hidden % tp:
            continue
        for pp in _divisors(cluster.gpus // tp):
            if model.layers % pp:
                continue
            dp = cluster.gpus // (tp * pp)
            for micro_batch in MICRO_BATCH_SIZES:
                if global_batch % (dp * micro_batch):
                    continue
                micro_batches = global_batch // (dp * micro_batch)
                for zero in ZERO_STAGES:
                    memory = memory_per_gpu(model, dp, tp, pp, zero, micro_batch,
                                            micro_batches)
                    if memory > budget:
                        continue
                    time = step_time(model, cluster, dp, tp, pp, zero, micro_batch,
                                     global_batch, mfu)["total"]
                    if best_key is None or (time, memory) < best_key:
                        best, best_key = (dp, tp, pp, zero, micro_batch), (time, memory)
    return best
