"""Megatron-style tensor-parallel layers, each built from this rank's exact slice of a dense
layer with ``from_dense(layer, group=None)``.

Shoeybi et al., Megatron-LM (2019), section 3. A linear layer ``Y = X A^T + b`` (A is
``out x in``) splits two ways:

* **column-parallel**: rank r keeps rows r of A (a slice of the *outputs*). Every rank needs
  the whole X, and produces ``Y_r``, its slice of the outputs: no communication forward.
* **row-parallel**: rank r keeps columns r of A (a slice of the *inputs*). Rank r needs only
  ``X_r`` and produces a partial sum of the whole Y; an all-reduce (``g``) adds them up.

Column then row, with the nonlinearity in between, needs one all-reduce forward: the GeLU of
``Y_r`` is local because GeLU is elementwise and column-parallel outputs are whole columns.

``sequence_parallel=True`` (Korthikanti et al., MLSys 2023, section 4.2.2): the activations
outside the column/row pair are split along the sequence. The column-parallel layer gathers
its input (and keeps only its shard for backward), the row-parallel layer reduce-scatters its
output, and a parameter that is whole on every rank but sees only ``s/t`` tokens there (a
LayerNorm's, a row-parallel bias) passes through f, so its gradient is summed over the ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.comm import ops
from engine.model.rmsnorm import RMSNorm
from engine.tp.mappings import (copy_to_tp, gather_from_tp, gathered_linear, reduce_from_tp,
                                reduce_scatter_to_sequence_parallel, scatter_to_tp)


def tp_rank_and_size(group=None) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def check_divisible(what: str, value: int, t: int) -> int:
    """``value // t``, or a clear error naming both."""
    if value % t:
        raise ValueError(f"{what}={value} is not divisible by the tensor-parallel degree {t}")
    return value // t


class ColumnParallelLinear(nn.Module):
    """Keeps ``out_features / t`` output rows. ``gather_output=True`` all-gathers the outputs
    so every rank has the whole Y; ``False`` leaves ``Y_r`` for a row-parallel layer.
    ``sequence_parallel=True`` takes this rank's ``s/t`` tokens and all-gathers them."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 gather_output: bool = True, group=None, device=None, dtype=None,
                 sequence_parallel: bool = False):
        super().__init__()
        _, t = tp_rank_and_size(group)
        self.local_out = check_divisible("out_features", out_features, t)
        if sequence_parallel and gather_output:
            raise ValueError("sequence_parallel=True feeds a row-parallel layer: pass "
                             "gather_output=False")
        self.group, self.gather_output = group, gather_output
        self.sequence_parallel = sequence_parallel
        like = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(self.local_out, in_features, **like))
        self.bias = nn.Parameter(torch.zeros(self.local_out, **like)) if bias else None

    @classmethod
    def from_dense(cls, layer: nn.Linear, group=None, gather_output: bool = True,
                   sequence_parallel: bool = False):
        rank, t = tp_rank_and_size(group)
        tp = cls(layer.in_features, layer.out_features, layer.bias is not None, gather_output,
                 group, layer.weight.device, layer.weight.dtype, sequence_parallel)
        with torch.no_grad():
            tp.weight.copy_(layer.weight.chunk(t, dim=0)[rank])
            if layer.bias is not None:
                tp.bias.copy_(layer.bias.chunk(t, dim=0)[rank])
        return tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return gathered_linear(x, self.weight, self.bias, self.group)
        y = F.linear(copy_to_tp(x, self.group), self.weight, self.bias)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Keeps ``in_features / t`` input columns; all-reduces the partial outputs (g). The bias
    is whole on every rank and added once, after the sum. ``input_is_parallel=True`` takes
    ``X_r`` (from a column-parallel layer); ``False`` takes the whole X and slices it.
    ``sequence_parallel=True`` reduce-scatters instead: each rank gets ``s/t`` whole tokens."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 input_is_parallel: bool = False, group=None, device=None, dtype=None,
                 sequence_parallel: bool = False):
        super().__init__()
        _, t = tp_rank_and_size(group)
        self.local_in = check_divisible("in_features", in_features, t)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel=True follows a column-parallel layer: pass "
                             "input_is_parallel=True")
        self.group, self.input_is_parallel = group, input_is_parallel
        self.sequence_parallel = sequence_parallel
        like = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in, **like))
        self.bias = nn.Parameter(torch.zeros(out_features, **like)) if bias else None

    @classmethod
    def from_dense(cls, layer: nn.Linear, group=None, input_is_parallel: bool = False,
                   sequence_parallel: bool = False):
        rank, t = tp_rank_and_size(group)
        tp = cls(layer.in_features, layer.out_features, layer.bias is not None,
                 input_is_parallel, group, layer.weight.device, layer.weight.dtype,
                 sequence_parallel)
        with torch.no_grad():
            tp.weight.copy_(layer.weight.chunk(t, dim=1)[rank])
            if layer.bias is not None:
                tp.bias.copy_(layer.bias)
        return tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel(F.linear(x, self.weight), self.group)
            bias = copy_to_tp(self.bias, self.group) if self.bias is not None else None
        else:
            y, bias = reduce_from_tp(F.linear(x, self.weight), self.group), self.bias
        return y + bias if bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Keeps ``vocab / t`` rows of the embedding table. A token outside this rank's rows
    looks up zeros; the all-reduce (g) fills in every token from the rank that owns it.
    ``sequence_parallel=True`` reduce-scatters instead: each rank gets ``s/t`` tokens."""

    def __init__(self, vocab: int, hidden: int, group=None, device=None, dtype=None,
                 sequence_parallel: bool = False):
        super().__init__()
        rank, t = tp_rank_and_size(group)
        self.local_vocab = check_divisible("vocab", vocab, t)
        self.start = rank * self.local_vocab
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(self.local_vocab, hidden, device=device,
                                               dtype=dtype))

    @classmethod
    def from_dense(cls, layer: nn.Embedding, group=None, sequence_parallel: bool = False):
        rank, t = tp_rank_and_size(group)
        tp = cls(layer.num_embeddings, layer.embedding_dim, group, layer.weight.device,
                 layer.weight.dtype, sequence_parallel)
        with torch.no_grad():
            tp.weight.copy_(layer.weight.chunk(t, dim=0)[rank])
        return tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.start + self.local_vocab)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(out, self.group)
        return reduce_from_tp(out, self.group)


class SequenceParallelLayerNorm(nn.LayerNorm):
    """A LayerNorm on this rank's ``s/t`` tokens. Its weight and bias are whole on every rank
    but each rank sees only its tokens, so they pass through f: the gradient of each is summed
    over the group in backward (Megatron-LM all-reduces these gradients after backward)."""

    group = None  # the tensor-parallel group (None: the world)

    @classmethod
    def from_dense(cls, ln: nn.LayerNorm, group=None):
        sp = cls(ln.normalized_shape, ln.eps, ln.elementwise_affine, device=ln.weight.device,
                 dtype=ln.weight.dtype)
        with torch.no_grad():
            sp.weight.copy_(ln.weight)
            sp.bias.copy_(ln.bias)
        sp.group = group
        return sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, copy_to_tp(self.weight, self.group),
                            copy_to_tp(self.bias, self.group), self.eps)


class SequenceParallelRMSNorm(RMSNorm):
    """:class:`engine.model.rmsnorm.RMSNorm` on this rank's ``s/t`` tokens; its gain passes
    through f, as :class:`SequenceParallelLayerNorm`'s weight does."""

    group = None  # the tensor-parallel group (None: the world)

    @classmethod
    def from_dense(cls, norm: RMSNorm, group=None):
        sp = cls(norm.weight.shape[0], norm.eps, device=norm.weight.device,
                 dtype=norm.weight.dtype)
        with torch.no_grad():
            sp.weight.copy_(norm.weight)
        sp.group = group
        return sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(x) * copy_to_tp(self.weight, self.group)


def sequence_parallel_norm(norm: nn.Module, group=None) -> nn.Module:
    """``norm`` (a LayerNorm or an RMSNorm) on this rank's ``s/t`` tokens."""
    if isinstance(norm, RMSNorm):
        return SequenceParallelRMSNorm.from_dense(norm, group)
    return SequenceParallelLayerNorm.from_dense(norm, group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split along the vocabulary, without gathering them
    (Megatron-LM's ``vocab_parallel_cross_entropy``): three all-reduces of one number per
    token (the max, the sum of exponentials, the target's logit) instead of ``V`` numbers."""

    @staticmethod
    def forward(ctx, logits, targets, start, group):
        top = logits.detach().max(dim=-1).values
        if dist.get_world_size(group) > 1:
            ops.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        local = targets - start
        inside = (local >= 0) & (local < logits.shape[-1])
        local = local.masked_fill(~inside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        if dist.get_world_size(group) > 1:
            ops.all_reduce(total, group=group)
            ops.all_reduce(picked, group=group)
        ctx.save_for_backward(exp / total.unsqueeze(-1), local, inside)
        return total.log() - picked

    @staticmethod
    def backward(ctx, grad):
        softmax, local, inside = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), -inside.unsqueeze(-1).to(softmax.dtype))
        return grad_logits * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group=None
                                 ) -> torch.Tensor:
    """Per-token loss from this rank's vocabulary slice of the logits (``[..., V/t]``)."""
    rank, _ = tp_rank_and_size(group)
    return _VocabParallelCrossEntropy.apply(logits, targets, rank * logits.shape[-1], group)
