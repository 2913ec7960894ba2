"""Exercise ch06.linear_b_w: a linear layer's backward, split into B and W.

Zero-bubble pipelines (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 2)
split the backward of ``Y = X Wᵀ + b`` in two:

* **B**, the input gradient ``dX``: the previous stage is waiting for it, so it runs now;
* **W**, the weight gradients ``dW`` and ``db``: nobody waits for them, so they can run
  later, in what would otherwise be a bubble, from the ``X`` and ``dY`` kept until then.

Fill in ``linear_b`` and ``linear_w``, save, then run ``check("ch06.linear_b_w")`` in
course/06_pipeline.ipynb (or ``make grade``). The checks compare them with autograd on 2-D
and 3-D inputs, then plug them into the engine's zero-bubble runtime (engine/pp/weight_grad.py)
and run ZB-H1 on 2 ranks: the gradients must equal one process's, B must produce no weight
gradient, and every W must use an output gradient that its B has already used.
"""

import torch


def linear_b(grad_out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """B: the gradient of the input of ``Y = X Wᵀ + b``.

    ``grad_out``: ``dY``, shape ``[..., out]`` (any leading dimensions); ``weight``: ``W``,
    ``[out, in]``. Return ``dX``, shaped like the input ``[..., in]``. Only ``dX``: the
    weights' gradients are W's job, later."""
    raise NotImplementedError("ch06.linear_b_w: write me")


def linear_w(x: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W: the gradients of the weight and the bias of ``Y = X Wᵀ + b``.

    ``x``: the layer's input ``[..., in]``; ``grad_out``: ``dY``, ``[..., out]``. Return
    ``(dW, db)``, shaped ``[out, in]`` and ``[out]``: each row of the micro-batch (every
    leading index) contributes, so sum over all of them."""
    raise NotImplementedError("ch06.linear_b_w: write me")
