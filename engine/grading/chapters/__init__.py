"""The checks, one module per chapter, and the registries read from them.

Each ``chNN.py`` lists its ``EXERCISES`` (:class:`engine.grading.core.Exercise`) and, where the
chapter has some, its ``DRILLS`` (:class:`engine.grading.drill.Drill`). This package finds the
chapter modules (a new ``chNN.py`` is picked up) and is the one place that collects them:
:func:`registry` for the exercises, :func:`drills` for the drills. The runner, the progress
table and ``python -m engine.grading`` all read these.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from engine.grading.core import Exercise


def chapter_modules() -> list[ModuleType]:
    """Every ``chNN`` module of this package, in chapter order (new chapters are found)."""
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name.startswith("ch"))
    return [importlib.import_module(f"{__name__}.{name}") for name in names]


def registry() -> dict[str, Exercise]:
    """Every exercise by name, from the ``EXERCISES`` list of every chapter module."""
    return {exercise.name: exercise for module in chapter_modules()
            for exercise in module.EXERCISES}


def get_exercise(name: str) -> Exercise:
    """The exercise called ``name`` ("ch01.ring_all_reduce"); ValueError naming the known
    ones otherwise."""
    exercises = registry()
    if name not in exercises:
        raise ValueError(f"no exercise named {name!r}; known exercises: {', '.join(exercises)}")
    return exercises[name]


def drills() -> dict:
    """Every drill by name (``{name: engine.grading.drill.Drill}``), from the ``DRILLS`` list of
    each chapter module that has one."""
    return {d.name: d for module in chapter_modules() for d in getattr(module, "DRILLS", [])}
