"""While an exercise is graded, the engine's own answer to it is switched off.

An exercise asks for something the engine already has: the ring all-reduce, 1F1B, Megatron's
f and g. ``Exercise.blocks`` names those implementations by dotted path
(``"engine.comm.ring.ring_all_reduce"``; a method:
``"engine.zero.optimizer.ZeroOptimizer.step"``).
Inside :func:`blocking`, each is replaced, wherever it is reachable, by a stand-in that raises
:class:`EngineAnswerBlocked` when the learner's code calls it:

* every module that holds the very same object (``from engine.comm import ring_all_reduce``
  in the learner's file, a notebook's namespace, ``engine.comm``'s re-export), and the values
  of the engine's module-level tables, or in the tuples they hold (``engine.pp.SCHEDULES``);
* for a method, the class that defines it.

The stand-in looks at who called it, past Python's and torch's own frames: the learner's code
gets the error; the engine, the checks included, gets the original (the checks compare with
the engine's answers, and the engine's collectives run on its own algorithms). Everything is
put back on exit.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

from engine.grading.core import Exercise
from engine.grading.feedback import is_learner_file

_ENGINE = Path(__file__).resolve().parents[1]
# code typed at a prompt; other "<...>" files are generated (dataclasses, torch) and decide nothing
_TYPED_IN = ("<ipython-input", "<stdin>", "<console>")


class EngineAnswerBlocked(RuntimeError):
    """The learner's code called the engine's own answer to the exercise being graded."""


def resolve(path: str) -> tuple[Any, str, Any]:
    """``(owner, name, raw)`` for a dotted path: the module or class holding the attribute, its
    name, and the attribute as stored there (a ``staticmethod`` stays one). Raises ValueError
    naming the path when it does not lead to anything."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:-1]:
                owner = getattr(owner, part)
        except AttributeError:
            break
        name = parts[-1]
        stored = vars(owner) if isinstance(owner, (ModuleType, type)) else {}
        if name in stored:
            return owner, name, stored[name]
        break
    raise ValueError(f"blocks: {path!r} names nothing in the engine (a module's function or a "
                     "class's method, as a dotted path)")


@functools.lru_cache(maxsize=4096)
def _who_wrote(file: str) -> str:
    """Who wrote ``file``: "engine" (the grader's checks included), "learner", or "" for
    Python, installed packages and generated code, which decide nothing."""
    if Path(file).is_absolute() and Path(file).resolve().is_relative_to(_ENGINE):
        return "engine"
    generated = file.startswith("<") and not file.startswith(_TYPED_IN)
    return "learner" if not generated and is_learner_file(file) else ""


def _learner_is_calling() -> bool:
    """True when the blocked function's caller, looking past Python's and torch's own frames
    (``autograd.Function.apply``), is the learner's code."""
    frame = sys._getframe(2)  # 0: here, 1: the stand-in, 2: its caller
    while frame is not None:
        who = _who_wrote(frame.f_code.co_filename)
        if who:
            return who == "learner"
        frame = frame.f_back
    return False


def _stand_in(original: Callable, path: str, exercise: Exercise, hard: bool = False) -> Callable:
    message = (f"{exercise.name} is being graded: {path} is the engine's own answer to it and "
               f"is switched off; write it yourself (check(\"{exercise.name}\", hint=2) names "
               "the tools to use)")

    if hard:  # the worker's: nobody calls the original, and the stand-in does not hold it
        def blocked(*args, **kwargs):
            raise EngineAnswerBlocked(message)
    else:
        def blocked(*args, **kwargs):
            if _learner_is_calling():
                raise EngineAnswerBlocked(message)
            return original(*args, **kwargs)

    blocked.engine_answer = path  # what it stands in for (see borrowed_answers)
    blocked.__name__ = getattr(original, "__name__", path.rsplit(".", 1)[-1])
    blocked.__qualname__ = getattr(original, "__qualname__", blocked.__name__)
    blocked.__doc__ = f"Switched off while {exercise.name} is graded: {message}."
    return blocked


def _swapped(items: tuple, old: Any, new: Any) -> tuple:
    """``items`` with ``new`` in place of ``old``, of the same type (a named tuple, such as
    :class:`engine.pp.registry.Schedule`, stays one)."""
    swapped = [new if x is old else x for x in items]
    return items._make(swapped) if hasattr(items, "_make") else tuple(swapped)


def _holders(original: Any) -> Iterator[tuple[dict, Any, Callable[[Any], Any]]]:
    """Every place a module keeps ``original``: ``(mapping, key, make)``, where ``make(value)``
    builds what the mapping should hold with ``value`` in place of ``original``."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        engine_module = getattr(module, "__name__", "").startswith("engine.")
        for key, value in list(namespace.items()):
            if value is original:
                yield namespace, key, lambda new: new
            elif engine_module and isinstance(value, dict):
                for inner_key, inner in list(value.items()):
                    if inner is original:
                        yield value, inner_key, lambda new: new
                    elif isinstance(inner, tuple) and any(x is original for x in inner):
                        yield value, inner_key, lambda new, t=inner: _swapped(t, original, new)


def borrowed_answers(impl: Any) -> list[str]:
    """The engine answers the learner's ``impl`` merely re-exports: a function that *is* a
    stand-in (``from engine.pp import interleaved_1f1b``, or an alias of it), or, for an
    exercise graded as a module, every such name in it. Call inside :func:`blocking`. A check
    calling it would be let through (the caller is the check), so it is refused up front."""
    if isinstance(impl, ModuleType):
        found = vars(impl).values()
    else:
        found = [impl]
    return sorted({getattr(f, "engine_answer") for f in found
                   if callable(f) and hasattr(f, "engine_answer")})


@contextlib.contextmanager
def blocking(exercise: Exercise, hard: bool = False):
    """Switch off ``exercise.blocks`` for the learner's code until the block ends.

    On exit every original is put back: where it was replaced, and wherever a module imported
    meanwhile (the learner's file, an engine module loaded late) picked up a stand-in.

    ``hard=True`` is the grading worker's (:mod:`engine.grading.worker`), whose checks compare
    in the grader's process and so never need the original: every caller gets the error, and
    nothing here keeps the original (no closure, no list to put it back from), so the
    learner's code cannot reach it through the stand-in. The block is then never left.
    """
    methods: list[tuple[type, str, Any]] = []  # (class, name, what it held)
    functions: list[tuple[Callable, Any]] = []  # (stand-in, original)
    try:
        for path in exercise.blocks:
            owner, name, raw = resolve(path)
            if isinstance(owner, type):
                wrapped = isinstance(raw, (staticmethod, classmethod))
                stand_in = _stand_in(raw.__func__ if wrapped else raw, path, exercise, hard)
                if not hard:
                    methods.append((owner, name, raw))
                setattr(owner, name, type(raw)(stand_in) if wrapped else stand_in)
            else:
                stand_in = _stand_in(raw, path, exercise, hard)
                if not hard:
                    functions.append((stand_in, raw))
                for mapping, key, make in list(_holders(raw)):
                    mapping[key] = make(stand_in)
            del owner, raw
        yield
    finally:
        for owner, name, raw in reversed(methods):
            setattr(owner, name, raw)
        for stand_in, original in functions:
            for mapping, key, make in list(_holders(stand_in)):
                mapping[key] = make(original)
