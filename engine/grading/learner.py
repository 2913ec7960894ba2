"""Finding and loading the learner's code: ``exercises/<module>.py`` in the course's folder.

The grader reads the files the learner edits, by path, from the course checkout: the folder
that holds ``course/`` and ``exercises/`` (and ``solutions/``, except in a student's release),
found from the working directory
upwards (a notebook runs in ``course/``, ``make grade`` at the top), else beside the engine.
A root given explicitly (``--root students/alice``) needs only ``exercises/``: what else it
lacks (the reference ``solutions/``, the notebooks' titles) comes from the installed course,
:func:`installed_course`.
``exercises`` and ``solutions`` are deliberately not installed as packages: an installed copy
would be graded instead of the file being edited, and such generic top-level names collide
with other projects'.

Each load compiles the file afresh, so a saved edit counts at the next ``check``. A file that
does not compile or import is reported as that exercise's failure (:class:`ExerciseLoadError`),
never as a crash of the whole grade run.
"""

from __future__ import annotations

import linecache
import sys
import types
from pathlib import Path
from typing import Callable

from engine.grading.core import Exercise

SOURCES = ("exercises", "solutions")
_MARKERS = ("course", "exercises")  # a student's release has no solutions/


class ExerciseLoadError(Exception):
    """The learner's file could not be loaded: it does not compile, import or define the name."""

    def __init__(self, message: str, path: Path, error: BaseException | None = None):
        super().__init__(message)
        self.message, self.path, self.error = message, path, error


def _is_course_root(folder: Path) -> bool:
    return all((folder / marker).is_dir() for marker in _MARKERS)


def installed_course() -> Path | None:
    """The course checkout the engine was installed from (the folder beside ``engine/``), or
    None when the engine was installed without one."""
    beside_engine = Path(__file__).resolve().parents[2]
    return beside_engine if _is_course_root(beside_engine) else None


def course_root(root: str | Path | None = None) -> Path:
    """The course checkout: ``root`` if given (a folder holding ``exercises/`` is enough: a
    student's submission), else the first folder from the working directory upwards that holds
    ``course/`` and ``exercises/``, else the engine's own."""
    if root is not None:
        folder = Path(root).resolve()
        if not (folder / "exercises").is_dir():
            raise ValueError(f"root must be a course folder holding exercises/ (a student's "
                             f"submission needs nothing else), got {str(folder)!r}")
        return folder
    here = Path.cwd().resolve()
    beside_engine = Path(__file__).resolve().parents[2]
    for folder in (here, *here.parents, beside_engine):
        if _is_course_root(folder):
            return folder
    raise FileNotFoundError(
        f"found no course folder (one holding {', '.join(_MARKERS)}/) in {here} or above it, "
        f"nor at {beside_engine}: run from the course checkout, or pass root=")


def exercise_path(exercise: Exercise, source: str = "exercises",
                  root: str | Path | None = None) -> Path:
    """``<root>/<source>/<module>.py``; the reference solutions of a root that holds none (a
    student's submission) are the installed course's."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    folder = course_root(root)
    installed = installed_course()
    if not (folder / source).is_dir() and installed is not None:
        folder = installed
    return folder / source / f"{exercise.module}.py"


def load_impl(exercise: Exercise, source: str = "exercises",
              root: str | Path | None = None) -> Callable | types.ModuleType:
    """Compile and run ``<root>/<source>/<module>.py`` afresh; return the function graded (or
    the module itself, for exercises with several functions).

    Raises :class:`ExerciseLoadError` when the file is missing, does not compile, raises while
    it is imported, or does not define ``exercise.attr``.
    """
    path = exercise_path(exercise, source, root)
    shown = f"{source}/{path.name}"
    if source == "solutions" and not path.parent.is_dir():
        raise ExerciseLoadError(f"this course has no solutions/ (a student's release): "
                                f"{shown} cannot be graded", path)
    if not path.is_file():
        raise ExerciseLoadError(f"{shown} does not exist (looked in {path.parent})", path)
    name = f"_course_{source}.{exercise.module}"  # private: never shadows a real package
    module = types.ModuleType(name)
    module.__file__ = str(path)
    linecache.checkcache(str(path))  # tracebacks quote the file as saved now
    sys.modules[name] = module  # dataclasses and pickle look their module up here
    try:
        exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    except SyntaxError as e:
        sys.modules.pop(name, None)
        raise ExerciseLoadError(f"{shown} does not compile: {e.msg} (line {e.lineno})",
                                path, e) from e
    except Exception as e:  # noqa: BLE001 - whatever the module body raises is the learner's
        sys.modules.pop(name, None)
        raise ExerciseLoadError(f"{shown} raised {type(e).__name__} while being imported: {e}",
                                path, e) from e
    if not exercise.attr:
        return module
    if not hasattr(module, exercise.attr):
        raise ExerciseLoadError(f"{shown} does not define {exercise.attr!r}: keep the stub's "
                                "name", path)
    return getattr(module, exercise.attr)
