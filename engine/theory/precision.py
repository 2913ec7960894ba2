"""Precision and memory (chapter 12): mixed precision, loss scaling, FP8, Muon, recomputation.

Part of :mod:`engine.theory`: pure formulas, each naming its source; sizes in bytes.
"""

from __future__ import annotations

from engine.validation import positive_int
from engine.theory.collectives import check_n


def mixed_precision_bytes_per_parameter(low_bytes: int = 2, master_gradient: bool = True,
                                        optimizer_bytes: int = 8) -> int:
    """Bytes per parameter of mixed-precision training with Adam (Micikevicius et al., "Mixed
    Precision Training", ICLR 2018): the fp32 master (4), the ``low_bytes`` working copy and
    its gradient, the fp32 gradient the optimizer reads (4; ``master_gradient=False`` when the
    update reads the low-precision gradient, the ZeRO paper's 2 + 2 + 12 = 16) and Adam's two
    fp32 moments (``optimizer_bytes`` = 8)."""
    return 4 + 2 * low_bytes + (4 if master_gradient else 0) + optimizer_bytes


def loss_scale_after(found_inf, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                     backoff_factor: float = 0.5, growth_interval: int = 2000
                     ) -> tuple[float, int, int]:
    """``(scale, clean steps counted, steps skipped)`` after dynamic loss scaling sees the
    ``found_inf`` flags in order (Micikevicius et al. 2018, section 3.2; ``torch.amp.GradScaler``'s
    rule): an inf/NaN step is skipped, the scale times ``backoff_factor``, the count reset; a
    clean step counts, and the ``growth_interval``-th in a row multiplies the scale by
    ``growth_factor`` (unless that overflows fp32) and resets the count."""
    scale, clean, skipped = float(init_scale), 0, 0
    for inf in found_inf:
        if inf:
            scale, clean, skipped = scale * backoff_factor, 0, skipped + 1
            continue
        clean += 1
        if clean == growth_interval:
            if scale * growth_factor <= 3.4028234663852886e38:  # torch.finfo(float32).max
                scale *= growth_factor
            clean = 0
    return scale, clean, skipped


def dim0_padding_rows(rows: int, n: int) -> int:
    """Rows of zeros FSDP2 pads a parameter of ``rows`` rows with on dim 0 over ``n`` ranks:
    ``ceil(rows / n) * n - rows`` (every rank's chunk ``ceil(rows / n)`` rows in the collectives;
    the local shard itself is not padded)."""
    check_n(n)
    return -(-rows // n) * n - rows


def fp8_all_gather_bytes(shard_numel: int, n: int, element_bytes: float = 1,
                         scale_bytes: float = 4) -> float:
    """Bytes each rank sends in an all-gather of its ``shard_numel``-element shard cast to FP8
    (``element_bytes`` = 1) with its own fp32 scale gathered beside it (one scale per shard,
    this engine's variant): ``(n-1) (numel + 4)``; bf16's is ``(n-1) 2 numel``
    (``element_bytes=2, scale_bytes=0``). torchao's float8 all-gather for FSDP2 keeps one scale
    per weight instead: ``scale_bytes=0`` here, plus the all-reduce of the amax before the cast
    (:func:`ring_all_reduce_rank_bytes` of one fp32 element)."""
    check_n(n)
    return (n - 1) * (shard_numel * element_bytes + scale_bytes)


def fp8_scale_count(m: int, k: int, n: int, tile: int = 128) -> int:
    """fp32 scales kept for an ``M x K`` activation in ``1 x tile`` tiles and a ``K x N``
    weight in ``tile x tile`` blocks (DeepSeek-V3 Technical Report, section 3.3.2):
    ``M K / tile + (K / tile)(N / tile)``."""
    for name, value in (("m", m), ("k", k), ("n", n)):
        positive_int(name, value)
    if k % tile or n % tile:
        raise ValueError(f"tile={tile} does not divide k={k} and n={n}")
    return m * k // tile + (k // tile) * (n // tile)


def muon_newton_schulz_flops(rows: int, cols: int, steps: int = 5) -> int:
    """Matmul FLOPs of Muon's quintic Newton-Schulz on a ``rows x cols`` matrix (Jordan et al.,
    "Muon", 2024), the smaller Gram matrix formed (``m = min``, ``n = max``): per step
    ``X X^T`` (``2 m^2 n``), its square (``2 m^3``) and the product with ``X`` (``2 m^2 n``)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


MUON_SCHEMES = ("owner", "gather")


def muon_step_bytes(scheme: str, psi: int, n: int, largest_owned: int = 0,
                    element_bytes: int = 4) -> int:
    """Bytes each rank sends (ring collectives) in one step of distributed Muon over ``n``
    data-parallel ranks, ``psi`` matrix elements in all:

    * ``"owner"``, each matrix owned by one rank (Keller Jordan's reference implementation,
      Essential AI's; :class:`engine.optim.DistributedMuon`): the gradients reduce-scattered to
      the owners and the new matrices all-gathered, every rank's segment padded to the largest
      owner's ``largest_owned`` elements: ``2 (n-1) largest_owned``;
    * ``"gather"``, Moonlight's Algorithm 1 (Liu et al., "Muon is Scalable for LLM Training",
      2025, section 2.3; :class:`engine.optim.GatherMuon`): ZeRO-1's even slices of
      ``ceil(psi / n)`` elements, the gradients reduce-scattered, the momentum-updated slices
      all-gathered (every rank then holds every matrix) and the new parameters all-gathered:
      ``3 (n-1) ceil(psi / n)``.

    Times ``element_bytes``."""
    check_n(n)
    if scheme == "owner":
        if not 0 < largest_owned <= psi:
            raise ValueError(f"largest_owned={largest_owned!r}: the elements of the most "
                             f"loaded owner, in (0, psi={psi}]")
        return 2 * (n - 1) * largest_owned * element_bytes
    if scheme == "gather":
        return 3 * (n - 1) * -(-psi // n) * element_bytes
    raise ValueError(f"scheme={scheme!r}; expected one of {MUON_SCHEMES}")


def muon_ns_flops_per_rank(scheme: str, shapes, owned=(), steps: int = 5) -> int:
    """Newton-Schulz FLOPs one rank runs in one distributed Muon step over the matrices of
    ``shapes`` ((rows, cols) each): ``"gather"`` (Moonlight's Algorithm 1) every matrix on every
    rank, so ``n`` times one process's work in all; ``"owner"`` only the matrices ``owned``
    (indices into ``shapes``), so each matrix once over the ranks. Each matrix
    :func:`muon_newton_schulz_flops`."""
    if scheme not in MUON_SCHEMES:
        raise ValueError(f"scheme={scheme!r}; expected one of {MUON_SCHEMES}")
    mine = range(len(shapes)) if scheme == "gather" else owned
    return sum(muon_newton_schulz_flops(*shapes[i], steps) for i in mine)


def recompute_activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int,
                                         heads: int, policy: str = "none", tp: int = 1) -> float:
    """Activation bytes per transformer layer kept for backward under a recomputation
    ``policy``, with tensor and sequence parallelism ``tp`` (Korthikanti et al., "Reducing
    activation recomputation in large transformer models", MLSys 2023, sections 4.2.2 and 5,
    Table 2): ``"none"`` ``34 s b h / t + 5 a s^2 b / t``; ``"selective"`` (recompute only the
    attention core: ``Q K^T``, softmax, its dropout, attention over values) ``34 s b h / t``;
    ``"full"`` (keep only the layer's 16-bit input) ``2 s b h / t``. For ``"full"`` Table 2
    gives ``2 s b h``, undivided; ``/ t`` is Megatron-LM's implementation with sequence
    parallelism, which checkpoints each rank's ``s / t`` shard of the input (an assumption
    beyond the table; equal to it at ``tp = 1``)."""
    check_n(tp)
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    kept = {"none": 34 * s * b * h + 5 * a * s * s * b, "selective": 34 * s * b * h,
            "full": 2 * s * b * h}
    if policy not in kept:
        raise ValueError(f"policy={policy!r}; expected one of {tuple(kept)}")
    return kept[policy] / t
