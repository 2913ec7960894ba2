"""Interview drills: short numeric questions with instant feedback in the notebook.

    drill("ch00.ring_bytes", 175)   # prints ✓ or ✗ and the reasoning
"""

from __future__ import annotations

import importlib
import math
import pkgutil
from dataclasses import dataclass

from engine.grading import chapters


@dataclass(frozen=True)
class Drill:
    name: str
    question: str
    answer: float
    explanation: str
    rel_tol: float = 0.01


def drills() -> dict[str, Drill]:
    """Every drill, from the ``DRILLS`` list of each ``engine/grading/chapters/ch*.py``."""
    found = {}
    for info in sorted(pkgutil.iter_modules(chapters.__path__), key=lambda m: m.name):
        if info.name.startswith("ch"):
            module = importlib.import_module(f"{chapters.__name__}.{info.name}")
            found.update({d.name: d for d in getattr(module, "DRILLS", [])})
    return found


def grade_drill(name: str, answer) -> bool | None:
    """True/False for a numeric answer; None when it is not answered yet."""
    known = drills()
    if name not in known:
        raise ValueError(f"no drill named {name!r}; known drills: {', '.join(known)}")
    if answer is None:
        return None
    try:
        value = float(answer)
    except (TypeError, ValueError):
        raise ValueError(f"answer drill {name!r} with a number, got {answer!r}") from None
    return math.isclose(value, known[name].answer, rel_tol=known[name].rel_tol)


def drill(name: str, answer=None) -> None:
    """Print the question, whether ``answer`` is right, and (once answered) the reasoning."""
    verdict = grade_drill(name, answer)  # raises on an unknown name or a non-number
    item = drills()[name]
    print(f"Q: {item.question}")
    if verdict is None:
        print("   (not answered yet: pass your answer as a number)")
    elif verdict:
        print(f"\033[32m✓ {answer} is right.\033[0m {item.explanation}")
    else:
        print(f"\033[31m✗ {answer} is not it.\033[0m Think again; the formula is in the "
              "cells above.")
