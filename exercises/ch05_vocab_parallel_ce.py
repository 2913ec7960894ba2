"""Exercise ch05.vocab_parallel_ce: the cross-entropy over logits split along the vocabulary.

With tensor parallelism the output layer is column-parallel: rank r holds the logits of its
``V/t`` words only, ``logits[..., V/t]``. Gathering the whole ``[tokens, V]`` to compute the
loss would send ``V`` numbers per token. Megatron-LM (Shoeybi et al. 2019, section 3) never
gathers them: a softmax needs only the max, the sum of exponentials and the target's logit,
one number per token each, and every rank can get them with an all-reduce.

Fill in ``_VocabParallelCrossEntropy.forward`` and ``.backward``, save, then run
``check("ch05.vocab_parallel_ce")`` in course/05_tensor_parallel.ipynb (or ``make grade``).
The checks compare the loss and the gradient of each rank's logits with the dense
``F.cross_entropy`` at 2 and 3 ranks, on logits large enough that exp() overflows unless the
max is subtracted first; and read the meter: all-reduces of a few numbers per token, never
the logits.
"""

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)

from engine.comm import ops  # noqa: F401  (all-reduce through ops, so the meter sees it)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """``loss[token] = log Σ_v exp(z_v) - z_target``, from this rank's slice of the ``z``."""

    @staticmethod
    def forward(ctx, logits, targets, group):
        """``logits``: ``[..., V/t]``, this rank's words ``rank * V/t ... (rank + 1) * V/t - 1``.
        ``targets``: ``[...]``, word ids in ``0 .. V-1``. Return the per-token loss ``[...]``.

        1. the max over the whole vocabulary: the local max, all-reduced with
           ``op=dist.ReduceOp.MAX`` (subtract it, so exp() cannot overflow);
        2. the sum of exp(z - max) over the whole vocabulary: the local sum, all-reduced;
        3. the target's (shifted) logit: the rank that holds the target word picks it, the
           others contribute 0; all-reduced;
        4. loss = log(sum) - picked. Save what backward needs (``ctx.save_for_backward``).
        """
        raise NotImplementedError("ch05.vocab_parallel_ce: write me")

    @staticmethod
    def backward(ctx, grad_loss):
        """The gradient of the loss with respect to this rank's logits is
        ``softmax(z) - onehot(target)`` (only where this rank holds the target), times
        ``grad_loss`` per token. No communication needed. Return one value per input of
        forward: ``(grad_logits, None, None)``."""
        raise NotImplementedError("ch05.vocab_parallel_ce: write me")


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group=None
                                 ) -> torch.Tensor:
    """Per-token loss from this rank's vocabulary slice of the logits."""
    return _VocabParallelCrossEntropy.apply(logits, targets, group)
