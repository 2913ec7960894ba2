"""Solution of ch11.checkpoint_interval: Young's waste C/T + T/(2M) and its minimum
T* = sqrt(2CM) (Young, CACM 1974)."""

import math


def waste_per_second(interval_s, checkpoint_s, mtbf_s):
    return checkpoint_s / interval_s + interval_s / (2 * mtbf_s)


def young_interval(checkpoint_s, mtbf_s):
    return math.sqrt(2 * checkpoint_s * mtbf_s)
