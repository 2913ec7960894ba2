"""Pure formulas the course checks against measurements. No ``torch.distributed`` in here.

One module per topic, every name also here as ``engine.theory.NAME``: the collectives
(:mod:`~engine.theory.collectives`), gradient compression (:mod:`~engine.theory.compression`),
ZeRO (:mod:`~engine.theory.zero`), tensor parallelism (:mod:`~engine.theory.tensor`), pipelines
(:mod:`~engine.theory.pipeline`), size and compute at scale (:mod:`~engine.theory.scale`), long
sequences (:mod:`~engine.theory.long_context`), mixture of experts (:mod:`~engine.theory.moe`),
slow links and failures (:mod:`~engine.theory.slow_links`), precision and memory
(:mod:`~engine.theory.precision`), rooflines (:mod:`~engine.theory.roofline`); beside them the
planner (:mod:`~engine.theory.planner`) and the GPU table (:mod:`~engine.theory.hardware`).

Each function names its source. Sizes are in bytes; ``n`` is the number of ranks in the group.

Communication volume of ring collectives (Patarasuk & Yuan, "Bandwidth optimal all-reduce
algorithms for clusters of workstations", JPDC 2009; the same factors nccl-tests uses for bus
bandwidth, see its doc/PERFORMANCE.md):

* reduce-scatter and all-gather: each rank sends and receives ``(n-1)/n * S``
  (``S`` = the size of the full, unsharded tensor);
* all-reduce = reduce-scatter + all-gather: ``2(n-1)/n * S`` each way per rank;
* broadcast as a pipelined chain: every rank but the root receives ``S``; every rank but the
  last in the chain forwards ``S``.
"""

from engine.theory.collectives import (all_reduce_critical_bytes, all_reduce_steps,
                                       all_to_all_bytes, alpha_beta_time, bus_bandwidth,
                                       chain_broadcast_bytes, check_n, collective_wire_bytes,
                                       fit_alpha_beta, flat_broadcast_bytes, ps_all_reduce_bytes,
                                       ring_all_gather_bytes, ring_all_reduce_bytes,
                                       ring_all_reduce_rank_bytes, ring_reduce_scatter_bytes,
                                       tree_all_reduce_bytes)
from engine.theory.compression import (powersgd_elements, topk_breakeven_ratio,
                                       topk_bytes_per_rank, topk_kept)
from engine.theory.zero import (offload_pcie_bytes, transformer_activation_bytes,
                                zero_comm_elements, zero_model_state_bytes)
from engine.theory.tensor import (tp_comm_elements_per_layer, tp_zero3_crossover_tokens,
                                  zero3_comm_elements_per_layer)
from engine.theory.pipeline import (bubble_fraction, one_f_one_b_bubble_time,
                                    pipeline_p2p_hops, pipeline_peak_activations,
                                    zb_h1_bubble_fraction, zb_h1_bubble_time, zb_h2_bubble_time)
from engine.theory.scale import (tp_activation_bytes_per_layer, training_days, transformer_flops,
                                 transformer_params)
from engine.theory.long_context import (CP_METHODS, activation_bytes_per_layer, allgather_cp_bytes,
                                        cp_memory_bytes, ring_attention_bytes,
                                        ring_attention_flops, ring_critical_path,
                                        sp_activation_bytes_per_layer, sp_comm_elements_per_layer,
                                        ulysses_beats_ring, ulysses_bytes, ulysses_sent_kv_heads,
                                        usp_bytes)
from engine.theory.moe import (deepseek_moe_params, expert_capacity, fine_grained, max_violation,
                               mla_attention_params, moe_all_to_all_bytes,
                               moe_forward_flops_per_token, moe_params)
from engine.theory.slow_links import (checkpoint_waste, daly_checkpoint_interval, diloco_bytes,
                                      diloco_peak_sync_bytes, diloco_syncs, hsdp_replica_bytes,
                                      young_checkpoint_interval)
from engine.theory.roofline import (attainable_flops, dp_min_tokens_per_gpu, matmul_intensity,
                                    mfu, ridge_intensity, tp_max_degree, tp_step_times)
from engine.theory.precision import (MUON_SCHEMES, dim0_padding_rows, fp8_all_gather_bytes,
                                     fp8_scale_count, loss_scale_after,
                                     mixed_precision_bytes_per_parameter, muon_newton_schulz_flops,
                                     muon_ns_flops_per_rank, muon_step_bytes,
                                     recompute_activation_bytes_per_layer)

__all__ = ["all_reduce_critical_bytes", "all_reduce_steps", "all_to_all_bytes", "alpha_beta_time",
           "bus_bandwidth", "chain_broadcast_bytes", "check_n", "collective_wire_bytes",
           "fit_alpha_beta", "flat_broadcast_bytes", "ps_all_reduce_bytes",
           "ring_all_gather_bytes", "ring_all_reduce_bytes", "ring_all_reduce_rank_bytes",
           "ring_reduce_scatter_bytes", "tree_all_reduce_bytes", "powersgd_elements",
           "topk_breakeven_ratio", "topk_bytes_per_rank", "topk_kept", "offload_pcie_bytes",
           "transformer_activation_bytes",
           "zero_comm_elements", "zero_model_state_bytes", "tp_comm_elements_per_layer",
           "tp_zero3_crossover_tokens",
           "zero3_comm_elements_per_layer", "bubble_fraction",
           "one_f_one_b_bubble_time", "pipeline_p2p_hops", "pipeline_peak_activations",
           "zb_h1_bubble_fraction", "zb_h1_bubble_time", "zb_h2_bubble_time",
           "tp_activation_bytes_per_layer", "training_days", "transformer_flops",
           "transformer_params", "CP_METHODS", "activation_bytes_per_layer", "allgather_cp_bytes",
           "cp_memory_bytes", "ring_attention_bytes", "ring_attention_flops", "ring_critical_path",
           "sp_activation_bytes_per_layer", "sp_comm_elements_per_layer", "ulysses_beats_ring",
           "ulysses_bytes", "ulysses_sent_kv_heads", "usp_bytes", "deepseek_moe_params",
           "expert_capacity", "fine_grained", "max_violation", "mla_attention_params",
           "moe_all_to_all_bytes", "moe_forward_flops_per_token", "moe_params", "checkpoint_waste",
           "daly_checkpoint_interval", "diloco_bytes", "diloco_peak_sync_bytes", "diloco_syncs",
           "hsdp_replica_bytes", "young_checkpoint_interval", "MUON_SCHEMES", "dim0_padding_rows",
           "fp8_all_gather_bytes", "fp8_scale_count", "loss_scale_after",
           "mixed_precision_bytes_per_parameter", "muon_newton_schulz_flops",
           "muon_ns_flops_per_rank", "muon_step_bytes", "recompute_activation_bytes_per_layer",
           "attainable_flops", "dp_min_tokens_per_gpu", "matmul_intensity", "mfu",
           "ridge_intensity", "tp_max_degree", "tp_step_times"]
