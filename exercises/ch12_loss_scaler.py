"""Exercise ch12.loss_scaler: one update of a dynamic loss scaler.

Fill in ``update_scale``, save, then run ``check("ch12.loss_scaler")`` in
course/12_precision_memory.ipynb (or ``make grade``). It is checked step by step on gradient
sequences you do not see (some steps with an inf or a NaN), against the decisions
``torch.amp.GradScaler`` makes on the same gradients: the scale after every step, and which
steps were skipped; and on the count of clean steps after a growth fp32 refuses.
"""


def update_scale(scale, clean_steps, found_inf, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000):
    """The scaler's decision after one backward pass.

    ``scale``: the loss scale used in this step; ``clean_steps``: how many steps in a row
    before this one had finite gradients (GradScaler's "growth tracker"); ``found_inf``: True
    when some gradient of this step is inf or NaN.

    Return ``(new_scale, new_clean_steps, skip)``:

    * an inf/NaN step is **skipped** (the optimizer must not step), the scale is multiplied by
      ``backoff_factor`` and the count of clean steps starts again from 0;
    * a clean step is taken and counted; when the count reaches ``growth_interval`` the scale
      is multiplied by ``growth_factor`` and the count starts again from 0.

    The scale is an fp32 number: a growth that would take it past fp32's largest value
    (about 3.4e38, ``torch.finfo(torch.float32).max``) is not applied (the count still
    restarts).
    """
    raise NotImplementedError("ch12.loss_scaler: write me")
