"""The checks, one module per chapter: each ``chNN.py`` lists its ``EXERCISES`` and ``DRILLS``."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def chapter_modules() -> list[ModuleType]:
    """Every ``chNN`` module of this package, in chapter order (new chapters are found)."""
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name.startswith("ch"))
    return [importlib.import_module(f"{__name__}.{name}") for name in names]
