"""Exercise ch11.checkpoint_interval: how often to checkpoint, given the failure rate.

Fill in both functions, save, then run ``check("ch11.checkpoint_interval")`` in
course/11_slow_links.ipynb (or ``make grade``). They are checked on hidden checkpoint costs
and mean times between failures, against Young's first-order model (Young, "A first order
approximation to the optimum checkpoint interval", CACM 1974).
"""

import math  # noqa: F401  (you will need it)


def waste_per_second(interval_s, checkpoint_s, mtbf_s):
    """The share of wall time wasted when a checkpoint costing ``checkpoint_s`` (C) is written
    after every ``interval_s`` (T) seconds of compute and failures come every ``mtbf_s`` (M)
    seconds on average: the time spent writing checkpoints, per second of compute, plus the
    work lost per failure (on average half an interval), per second."""
    raise NotImplementedError("ch11.checkpoint_interval: write me")


def young_interval(checkpoint_s, mtbf_s):
    """The interval T (seconds of compute between checkpoints) that makes
    :func:`waste_per_second` least."""
    raise NotImplementedError("ch11.checkpoint_interval: write me")
