"""The checks, one module per chapter: each ``chNN.py`` lists its ``EXERCISES`` and ``DRILLS``."""
