"""Exercise ch07.planner: memory per GPU of a layout, and the fastest layout that fits.

``engine.theory.planner`` sizes a real run from two models: the bytes each GPU holds (model states
sharded by tensor and pipeline parallelism and by the ZeRO stage, plus the activations the
first pipeline stage holds), and the time of a step (compute, the tensor-parallel
all-reduces, the pipeline bubble and sends, the data-parallel all-reduce).

Fill in ``memory_per_gpu`` and ``fastest_layout``, save, then run ``check("ch07.planner")`` in
course/07_3d_parallelism.ipynb (or ``make grade``). Both are checked at random models,
clusters and batch sizes against ``engine.theory.planner``.
"""

from engine import theory  # noqa: F401  (zero_model_state_bytes, activation_bytes_per_layer)
from engine.theory.planner import Cluster, ModelSpec, step_time  # noqa: F401  (the step-time model)

MICRO_BATCH_SIZES = (1, 2, 4, 8)
ZERO_STAGES = (0, 1, 2, 3)
RESERVE = 0.1  # a layout fits if it needs at most (1 - RESERVE) of a GPU's memory


def memory_per_gpu(model: ModelSpec, dp: int, tp: int, pp: int, zero: int, micro_batch: int,
                   micro_batches: int) -> float:
    """Bytes one GPU holds, mixed-precision Adam, full activation recomputation:

    * model states: the GPU holds ``model.params / (tp * pp)`` parameters, and the ZeRO stage
      shards their 2 + 2 + 12 bytes over the ``dp`` ranks
      (``theory.zero_model_state_bytes(params, dp, zero)["total"]``);
    * activations: the first pipeline stage holds ``min(pp, micro_batches)`` micro-batches
      (1F1B) of its ``model.layers / pp`` layers, each layer
      ``theory.activation_bytes_per_layer(model.seq_len, micro_batch, model.hidden,
      model.heads, tp, 1, False, True)`` bytes.
    """
    raise NotImplementedError("ch07.planner: write me")


def fastest_layout(model: ModelSpec, cluster: Cluster, global_batch: int,
                   mfu: float = 0.5) -> tuple[int, int, int, int, int] | None:
    """The fastest ``(dp, tp, pp, zero, micro_batch)`` that fits, or ``None`` if none does.

    A layout is valid when ``dp * tp * pp == cluster.gpus``; ``tp`` stays inside a node
    (``<= cluster.gpus_per_node``) and divides ``model.heads`` and ``model.hidden``; ``pp``
    divides ``model.layers``; ``micro_batch`` is one of ``MICRO_BATCH_SIZES`` and
    ``dp * micro_batch`` divides ``global_batch`` (then each data-parallel rank runs
    ``global_batch // (dp * micro_batch)`` micro-batches); ``zero`` is one of
    ``ZERO_STAGES``. It fits when ``memory_per_gpu`` is at most ``(1 - RESERVE)`` of
    ``cluster.memory_gb * 1e9`` bytes. Its time is
    ``step_time(model, cluster, dp, tp, pp, zero, micro_batch, global_batch, mfu)["total"]``.
    Fastest first; between equally fast layouts, the one that needs less memory.
    """
    raise NotImplementedError("ch07.planner: write me")
