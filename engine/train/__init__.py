"""``python -m engine train``, top down; each module imports only the ones below it:

* :mod:`~engine.train.cli`: the flags, :class:`~engine.train.cli.TrainConfig`, ``main``;
  :mod:`~engine.train.checks` (every bound, before any rank starts),
  :mod:`~engine.train.resume` (which checkpoint, checked), :mod:`~engine.train.endings`
  (Ctrl-C, a lost peer: one line each);
* :mod:`~engine.train.run`: one rank's run: it builds the strategy, runs it, and reports
  (:mod:`~engine.train.report`, :mod:`~engine.train.formulas`);
* :mod:`~engine.train.composed`: the engine's strategy (one plan, its mesh, ``parallelize``,
  ``compose.loop.train_step`` on step k's batch); :mod:`~engine.train.torch_baseline`:
  ``--impl torch``, PyTorch's wrappers on the same GPT and data;
* :mod:`~engine.train.timed_steps`: the measured outer loop (warm-up, timed steps, bytes by
  group) over the :class:`~engine.train.strategy.Strategy` record (:mod:`~engine.train.strategy`);
  :mod:`~engine.train.nonfinite` stops a run whose loss is not finite.
"""
