"""Exercise ch11.diloco_outer_step: DiLoCo's outer step, the one that runs every H steps.

Fill in ``outer_step``, save, then run ``check("ch11.diloco_outer_step")`` in
course/11_slow_links.ipynb (or ``make grade``). It is checked on inputs you do not see, over
several outer steps in a row, against ``torch.optim.SGD(momentum=..., nesterov=...)`` applied
to the pseudo-gradient (Douillard et al., 2023, Algorithm 1).
"""

import torch  # noqa: F401  (you will need it)


def outer_step(start, ends, outer_lr, momentum, buffer, nesterov=True):
    """One outer step of DiLoCo.

    ``start``: the global parameters θ every replica started the H inner steps from (a flat
    tensor). ``ends``: a list, each replica's parameters θ_i after its H inner steps (same
    shape). ``buffer``: the outer momentum m (zeros before the first outer step).

    Return ``(new_params, new_buffer)``, new tensors (leave the inputs as they are):

    * the pseudo-gradient Δ is the mean over the replicas of θ - θ_i (start minus end: it
      points uphill, like a gradient);
    * m ← momentum · m + Δ;
    * with Nesterov, θ ← θ - outer_lr · (Δ + momentum · m); without, θ ← θ - outer_lr · m.
    """
    raise NotImplementedError("ch11.diloco_outer_step: write me")
