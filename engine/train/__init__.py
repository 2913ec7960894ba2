"""``python -m engine train``, top down; each module imports only the ones below it:

* :mod:`~engine.train.cli`: the flags, :class:`~engine.train.cli.TrainConfig`, ``main``;
  :mod:`~engine.train.checks` (every bound, before any rank starts),
  :mod:`~engine.train.resume` (which checkpoint, checked), :mod:`~engine.train.endings`
  (Ctrl-C, a lost peer: one line each);
* :mod:`~engine.train.run`: one rank's run, its report (:mod:`~engine.train.report`,
  :mod:`~engine.train.formulas`);
* :mod:`~engine.train.strategy`: the engine's composed strategy
  (:mod:`~engine.train.composed`) or PyTorch's wrappers (``--impl torch``);
* :mod:`~engine.train.timed_steps`: the measured outer loop (warm-up, timed steps, bytes by
  group) over :mod:`~engine.train.steps`; :mod:`~engine.train.nonfinite` stops a run whose
  loss is not finite.
"""
