"""The grader: one set of checks per exercise, used three ways.

* In a notebook, ``check("ch00.p2p_broadcast")`` runs the checks on the learner's code in
  ``exercises/`` (or on a function passed as ``impl=``) and prints pass or fail, with a hint and
  the failing inputs.
* ``python -m tests.grading`` (``make grade``) prints a score table per chapter and writes junit
  XML.
* ``tests/test_grading.py`` proves, for every exercise, that each check passes on ``solutions/``
  and fails on the untouched stub in ``exercises/``.

An exercise is a triple: a stub ``exercises/<module>.py``, a reference ``solutions/<module>.py``
with the same names, and an :class:`Exercise` in a ``tests/grading/chNN.py`` module here.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.launch import LaunchError, RankError, RankTimeoutError

SOURCES = ("exercises", "solutions")


class CheckFailed(AssertionError):
    """Raised by a check: ``message`` says what was wrong, ``inputs`` what it was given."""

    def __init__(self, message: str, **inputs: Any):
        super().__init__(message)
        self.message = message
        self.inputs = inputs


@dataclass(frozen=True)
class Exercise:
    name: str  # "ch00.p2p_broadcast": chapter prefix, then the exercise
    module: str  # the module in exercises/ and solutions/, e.g. "ch00_p2p_broadcast"
    attr: str  # the function the learner writes, e.g. "p2p_broadcast"; "" grades the module
    checks: tuple[Callable[[Callable], None], ...]
    hint: str
    title: str = ""

    @property
    def chapter(self) -> str:
        return self.name.split(".")[0]


@dataclass
class CheckResult:
    name: str
    passed: bool
    message: str = ""
    inputs: dict = field(default_factory=dict)
    not_implemented: bool = False


@dataclass
class Report:
    exercise: Exercise
    source: str
    results: list[CheckResult]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def score(self) -> tuple[int, int]:
        return sum(r.passed for r in self.results), len(self.results)


def registry() -> dict[str, Exercise]:
    """Every exercise, from every ``tests/grading/ch*.py`` module's ``EXERCISES`` list."""
    found: dict[str, Exercise] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("ch"):
            module = importlib.import_module(f"{__name__}.{info.name}")
            for exercise in module.EXERCISES:
                found[exercise.name] = exercise
    return found


def get_exercise(name: str) -> Exercise:
    exercises = registry()
    if name not in exercises:
        raise ValueError(f"no exercise named {name!r}; known exercises: {', '.join(exercises)}")
    return exercises[name]


def load_impl(exercise: Exercise, source: str = "exercises") -> Callable:
    """Import (afresh, so edits count) ``<source>/<module>.py``; return the function graded
    (or the module itself, for exercises with several functions)."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    module_name = f"{source}.{exercise.module}"
    if module_name in sys.modules:
        module = importlib.reload(sys.modules[module_name])
    else:
        module = importlib.import_module(module_name)
    return getattr(module, exercise.attr) if exercise.attr else module


def run_checks(name: str, impl: Callable | None = None, source: str = "exercises") -> Report:
    """Run every check of exercise ``name`` against ``impl`` (default: the one in ``source``)."""
    exercise = get_exercise(name)
    if impl is not None and exercise.attr and not callable(impl):
        raise ValueError(f"impl must be a function, got {impl!r}")
    label = "impl" if impl is not None else source
    impl = impl if impl is not None else load_impl(exercise, source)
    return Report(exercise, label, [_run_one(check_fn, impl) for check_fn in exercise.checks])


def _run_one(check_fn: Callable, impl: Callable) -> CheckResult:
    name = check_fn.__name__.removeprefix("check_")
    try:
        check_fn(impl)
    except NotImplementedError:
        return CheckResult(name, False, "not implemented yet", not_implemented=True)
    except RankError as e:
        if e.exc_type == "NotImplementedError":
            return CheckResult(name, False, "not implemented yet", not_implemented=True)
        return CheckResult(name, False, f"rank {e.rank} raised {e.exc_type}: "
                           f"{str(e).splitlines()[0].split(': ', 1)[-1]}")
    except RankTimeoutError as e:
        return CheckResult(name, False, f"ranks {e.ranks} never finished: is every send matched "
                           "by a receive on the peer, in the same order?")
    except LaunchError as e:
        return CheckResult(name, False, str(e).splitlines()[0])
    except CheckFailed as e:
        return CheckResult(name, False, e.message, e.inputs)
    except Exception as e:  # the learner's code raised in this process
        return CheckResult(name, False, f"{type(e).__name__}: {e}")
    return CheckResult(name, True)


_GREEN, _RED, _DIM, _RESET = "\033[32m", "\033[31m", "\033[2m", "\033[0m"


def format_report(report: Report, color: bool = True) -> str:
    g, r, d, x = (_GREEN, _RED, _DIM, _RESET) if color else ("", "", "", "")
    got, total = report.score
    head = f"{report.exercise.name}: {got}/{total} checks passed"
    lines = [f"{g if report.passed else r}{'PASS' if report.passed else 'FAIL'}{x} {head}"]
    for res in report.results:
        mark = f"{g}✓{x}" if res.passed else f"{r}✗{x}"
        lines.append(f"  {mark} {res.name}" + ("" if res.passed else f": {res.message}"))
        for key, value in res.inputs.items():
            lines.append(f"      {d}{key} = {value!r}{x}")
    if not report.passed:
        lines.append(f"  {d}hint: {report.exercise.hint}{x}")
    return "\n".join(lines)


def check(name: str, impl: Callable | None = None) -> None:
    """Grade exercise ``name`` and print the result (use :func:`run_checks` for the data).

    Without ``impl`` the function in ``exercises/<module>.py`` is graded (re-imported, so save
    the file first); pass ``impl=my_function`` to grade one defined in the notebook instead.
    """
    print(format_report(run_checks(name, impl=impl)))
