"""Plan dp x tp x pp x ZeRO for a real model on a real cluster: memory per GPU and a step-time
model, every configuration enumerated, the ones that fit ranked by predicted time.

Memory per GPU (mixed-precision Adam, 2 + 2 + 12 bytes per parameter):
    model states of psi / (tp * pp) parameters, sharded over dp by the ZeRO stage
    (:func:`engine.theory.zero_model_state_bytes`), plus the activations of the first
    pipeline stage, which under 1F1B holds min(pp, m) micro-batches of its L / pp layers
    (Korthikanti et al. 2023, eq. 2 with tensor parallelism; 2sbh per layer with
    recomputation).

Step time (seconds), nothing overlapped (a conservative model; real systems hide part of the
data-parallel all-reduce behind backward):
    compute   = FLOPs per GPU / (MFU * peak)           (Megatron-LM eq. 3)
    tp        = 4 (6 with recomputation) all-reduces of b*s*h fp16 values per layer per
                micro-batch, over NVLink when tp fits in a node (alpha-beta ring model)
    bubble    = (pp - 1) / m * (compute + tp)          (1F1B, relative to ideal time)
    pp        = 2m point-to-point messages of b*s*h fp16 values between neighbour stages
    dp        = gradient all-reduce, 2(d-1)/d * 2 bytes * psi/(tp*pp) (3(d-1)/d for ZeRO-3)

Long sequences (chapter 09): ``cp_degrees`` adds context parallelism (ring attention), each
rank holding s/cp tokens of every activation (:func:`engine.theory.activation_bytes_per_layer`),
    cp        = ring attention K/V (and dK/dV) per layer per micro-batch,
                theory.ring_attention_bytes, over NVLink while tp x cp fits in a node;
and ``sequence_parallel=True`` turns on Megatron sequence parallelism wherever tp > 1
(activations of Korthikanti et al. section 4.2.2; one more all-reduce's worth of traffic per
layer, the backward re-gather). The GPUs are dp x ep x cp x tp x pp; the context-parallel
ranks share each micro-batch and average gradients with the data-parallel ones.

The alpha, bandwidth and MFU figures are assumptions you can change (``Cluster``), not
measurements: a plan is as good as its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine import theory
from engine.theory.hardware import GPU_SPECS, cluster_specs

A100 = GPU_SPECS["NVIDIA A100-SXM4-80GB"]  # the default Cluster's GPU


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int = 51200
    seq_len: int = 2048
    # Mixture of experts (chapter 10): every MLP is ``experts`` experts, ``top_k`` per token,
    # counted by theory.moe_params (experts of ``ffn_hidden``, SwiGLU if ``gated``, grouped-query
    # keys and values of ``kv_hidden``).
    experts: int = 1
    top_k: int = 1
    ffn_hidden: int = 0
    kv_hidden: int = 0
    gated: bool = True

    @property
    def is_moe(self) -> bool:
        return self.experts > 1

    def _moe(self, top_k: int) -> dict:
        return theory.moe_params(self.layers, self.hidden, self.ffn_hidden, self.experts,
                                 top_k, self.vocab, self.kv_hidden or None, self.gated)

    @property
    def params(self) -> float:
        if self.is_moe:
            return self._moe(self.top_k)["total"]
        return theory.transformer_params(self.layers, self.hidden, self.vocab, self.seq_len)

    @property
    def expert_params(self) -> float:
        """Parameters in experts, all layers (0 for a dense model)."""
        return self.layers * self.experts * self._moe(1)["expert"] if self.is_moe else 0.0


@dataclass(frozen=True)
class Cluster:
    """GPUs and links. Defaults: A100 80GB (:data:`engine.theory.hardware.GPU_SPECS`), 312 TFLOP/s
    bf16 dense, NVLink 3 at 300 GB/s per direction per GPU, one 200 Gb/s HDR InfiniBand NIC per
    GPU (25 GB/s); latencies are typical orders of magnitude."""

    gpus: int
    gpus_per_node: int = 8
    memory_gb: float = A100.memory_gb
    peak_tflops: float = A100.bf16_tflops
    intra_gbps: float = A100.nvlink_gbps
    inter_gbps: float = A100.network_gbps
    alpha_intra: float = 5e-6
    alpha_inter: float = 1e-5


MODELS = {
    "GPT-2 1.5B": ModelSpec("GPT-2 1.5B", 48, 1600, 25, 50257, 1024),
    "LLaMA 7B": ModelSpec("LLaMA 7B", 32, 4096, 32, 32000, 2048),
    "LLaMA 13B": ModelSpec("LLaMA 13B", 40, 5120, 40, 32000, 2048),
    "LLaMA 65B": ModelSpec("LLaMA 65B", 80, 8192, 64, 32000, 2048),
    "GPT-3 175B": ModelSpec("GPT-3 175B", 96, 12288, 96, 51200, 2048),
    # Jiang et al. 2024, table 1: 8 experts, top-2, SwiGLU of 14336, 8 kv heads of 128
    "Mixtral 8x7B": ModelSpec("Mixtral 8x7B", 32, 4096, 32, 32000, 4096, experts=8, top_k=2,
                              ffn_hidden=14336, kv_hidden=1024),
}
# the GPUs the planner offers, each a Cluster's settings from engine.theory.hardware's table
GPUS = {label: cluster_specs(device) for label, device in (
    ("A100 80GB", "NVIDIA A100-SXM4-80GB"), ("H100 80GB", "NVIDIA H100 80GB HBM3"),
    ("H200 141GB", "NVIDIA H200"))}


@dataclass
class Plan:
    dp: int
    tp: int
    pp: int
    zero: int
    micro_batch: int
    micro_batches: int
    memory: dict = field(default_factory=dict)  # bytes per GPU by part, and "total"
    time: dict = field(default_factory=dict)  # seconds per step by part, and "total"
    ep: int = 1  # expert parallelism: each expert on dp ranks, dense weights on dp x ep
    cp: int = 1  # context parallelism: s/cp tokens per rank (ring attention)
    sp: bool = False  # Megatron sequence parallelism inside the tp group

    def label(self) -> str:
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        sp = "+sp" if self.sp else ""
        return (f"dp{self.dp}{ep}{cp} tp{self.tp}{sp} pp{self.pp} ZeRO-{self.zero} "
                f"mb{self.micro_batch} x{self.micro_batches}")


def memory_per_gpu(model: ModelSpec, dp: int, tp: int, pp: int, zero: int, micro_batch: int,
                   micro_batches: int, recompute: bool = True, ep: int = 1, cp: int = 1,
                   sp: bool = False) -> dict:
    # an MoE's experts are split over ep and sharded by ZeRO over their dp replicas; the
    # dense weights are on all dp x ep data-parallel ranks (engine.compose.experts);
    # context-parallel ranks hold replicas too, and ZeRO shards over them as well
    # (Megatron-Core's dp x cp)
    dense = (model.params - model.expert_params) / (tp * pp)
    states = theory.zero_model_state_bytes(dense, dp * ep * cp, zero)
    if model.is_moe:
        experts = theory.zero_model_state_bytes(model.expert_params / (tp * pp * ep), dp * cp,
                                                zero)
        states = {part: states[part] + experts[part] for part in states}
    in_flight = min(pp, micro_batches)
    per_layer = theory.activation_bytes_per_layer(model.seq_len, micro_batch, model.hidden,
                                                  model.heads, tp, cp, sp, recompute)
    activations = in_flight * (model.layers / pp) * per_layer
    out = {"params": states["params"], "grads": states["grads"],
           "optimizer": states["optimizer"], "activations": activations}
    out["total"] = sum(out.values())
    return out


def _ring(bytes_: float, n: int, alpha: float, gbps: float) -> float:
    if n == 1:
        return 0.0
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * bytes_ / (gbps * 1e9)


def step_time(model: ModelSpec, cluster: Cluster, dp: int, tp: int, pp: int, zero: int,
              micro_batch: int, global_batch: int, mfu: float = 0.5,
              recompute: bool = True, ep: int = 1, cp: int = 1, sp: bool = False) -> dict:
    m = global_batch // (dp * ep * micro_batch)
    s, h, n = model.seq_len, model.hidden, cluster.gpus
    tokens = micro_batch * s / cp  # this rank's tokens of a micro-batch
    flops = _step_flops(model, global_batch, recompute) / n
    compute = flops / (mfu * cluster.peak_tflops * 1e12)
    node = cluster.gpus_per_node
    tp_link = (cluster.alpha_intra, cluster.intra_gbps) if tp <= node else \
        (cluster.alpha_inter, cluster.inter_gbps)
    activation = tokens * h * 2
    tp_ops = (6 if recompute else 4) + (1 if sp and tp > 1 else 0)
    tp_time = tp_ops * (model.layers / pp) * m * _ring(activation, tp, *tp_link)
    # ring attention: 3(cp-1) steps, 3 (4 with recomputation) times the forward's K/V bytes
    # per layer per micro-batch; each tensor-parallel rank passes only its own heads' K/V
    cp_link = (cluster.alpha_intra, cluster.intra_gbps) if tp * cp <= node else \
        (cluster.alpha_inter, cluster.inter_gbps)
    ring = theory.ring_attention_bytes(micro_batch * s, model.kv_hidden or h, cp, 2)
    cp_bytes = (ring["total"] + (ring["forward"] if recompute else 0)) / tp
    cp_time = 0.0 if cp == 1 else (model.layers / pp) * m * (
        3 * (cp - 1) * cp_link[0] + cp_bytes / (cp_link[1] * 1e9))
    # expert parallelism: 4 all-to-alls per MoE layer per micro-batch (6 with recomputation)
    # of b*s*k*h fp16 values, over NVLink while the tp x ep ranks of a group fit in a node
    ep_link = (cluster.alpha_intra, cluster.intra_gbps) if tp * ep <= node else \
        (cluster.alpha_inter, cluster.inter_gbps)
    ep_time = 0.0 if ep == 1 else (6 if recompute else 4) * (model.layers / pp) * m * (
        (ep - 1) * ep_link[0] + theory.moe_all_to_all_bytes(
            tokens, h, model.top_k, ep, 2)["dispatch"] / (ep_link[1] * 1e9))
    pp_link = (cluster.alpha_intra, cluster.intra_gbps) if dp * ep * cp * tp * pp <= node else \
        (cluster.alpha_inter, cluster.inter_gbps)
    pp_time = 0.0 if pp == 1 else 2 * m * (pp_link[0] + activation / (pp_link[1] * 1e9))
    dp_link = (cluster.alpha_intra, cluster.intra_gbps) if dp * ep * cp * tp <= node else \
        (cluster.alpha_inter, cluster.inter_gbps)
    dense_bytes = 2 * (model.params - model.expert_params) / (tp * pp)
    expert_bytes = 2 * model.expert_params / (tp * pp * ep)
    dp_time = (_ring(dense_bytes, dp * ep * cp, *dp_link)
               + _ring(expert_bytes, dp * cp, *dp_link)) * (1.5 if zero == 3 else 1.0)
    bubble = (pp - 1) / m * (compute + tp_time + ep_time + cp_time)
    out = {"compute": compute, "tp": tp_time, "ep": ep_time, "cp": cp_time, "bubble": bubble,
           "pp": pp_time, "dp": dp_time}
    out["total"] = sum(out.values())
    return out


def _step_flops(model: ModelSpec, global_batch: int, recompute: bool) -> float:
    """FLOPs of one step: Megatron-LM's eq. 3 for a dense model; for an MoE, 3 passes (4 with
    recomputation) of its forward FLOPs per token over the active parameters
    (theory.moe_forward_flops_per_token) plus the output layer, 2 V h per token."""
    s, h = model.seq_len, model.hidden
    if not model.is_moe:
        return theory.transformer_flops(global_batch, s, model.layers, h, model.vocab,
                                        recompute)
    per_token = theory.moe_forward_flops_per_token(
        model.layers, h, model.ffn_hidden, model.experts, model.top_k, s,
        model.kv_hidden or None, model.gated) + 2 * model.vocab * h
    return (4 if recompute else 3) * global_batch * s * per_token


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan(model: ModelSpec, cluster: Cluster, global_batch: int, mfu: float = 0.5,
         zero_stages=(0, 1, 2, 3), micro_batch_sizes=(1, 2, 4, 8), recompute: bool = True,
         reserve: float = 0.1, cp_degrees=(1,), sequence_parallel: bool = False) -> list[Plan]:
    """Every (dp, tp, pp, ZeRO stage, micro-batch) that fits in ``(1 - reserve)`` of a GPU's
    memory, fastest first (ties: less memory first). tp stays within a node and divides the
    heads; pp divides the layers; dp * tp * pp = the GPU count; the global batch splits into
    whole micro-batches. For an MoE model also every expert-parallel degree ep dividing the
    experts: then dp x ep x tp x pp = the GPU count, each expert on dp ranks. Each of
    ``cp_degrees`` whose zig-zag split the sequence allows (2 cp divides it) adds a context-
    parallel degree: dp x ep x cp x tp x pp GPUs. ``sequence_parallel`` applies it with tp > 1."""
    if cluster.gpus < 1 or global_batch < 1:
        raise ValueError(f"need gpus >= 1 and global_batch >= 1, got {cluster.gpus} and "
                         f"{global_batch}")
    budget = (1 - reserve) * cluster.memory_gb * 1e9
    plans = []
    for tp in _divisors(cluster.gpus):
        if tp > cluster.gpus_per_node or model.heads % tp or model.hidden % tp:
            continue
        for pp in _divisors(cluster.gpus // tp):
            if model.layers % pp:
                continue
            sp = sequence_parallel and tp > 1
            for cp in cp_degrees:
                if (cluster.gpus // (tp * pp)) % cp or model.seq_len % (2 * cp):
                    continue
                data = cluster.gpus // (tp * pp * cp)  # data-parallel ranks: dp x ep
                for ep in [e for e in _divisors(data) if model.experts % e == 0]:
                    dp = data // ep
                    for mb in micro_batch_sizes:
                        if global_batch % (data * mb):
                            continue
                        m = global_batch // (data * mb)
                        for zero in zero_stages:
                            memory = memory_per_gpu(model, dp, tp, pp, zero, mb, m, recompute,
                                                    ep, cp, sp)
                            if memory["total"] > budget:
                                continue
                            time = step_time(model, cluster, dp, tp, pp, zero, mb,
                                             global_batch, mfu, recompute, ep, cp, sp)
                            plans.append(Plan(dp, tp, pp, zero, mb, m, memory, time, ep, cp,
                                              sp))
    return sorted(plans, key=lambda p: (p.time["total"], p.memory["total"]))
