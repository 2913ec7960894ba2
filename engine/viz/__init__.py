"""Figures and widgets, built only on :mod:`engine.theory`, :mod:`engine.observe.trace` and results.

Every widget has a plain function that draws the same figure statically, so a notebook shows a
picture in nbval, on GitHub, and anywhere widgets do not render.
"""

from engine.viz.comm import all_reduce_explorer, all_reduce_figure, bytes_per_rank_figure
from engine.viz.style import apply_style

__all__ = ["apply_style", "bytes_per_rank_figure", "all_reduce_figure", "all_reduce_explorer"]
