"""Running an exercise's checks and turning whatever happens into a :class:`CheckResult`."""

from __future__ import annotations

import inspect
import re
import types
from pathlib import Path
from typing import Callable, Iterator

from engine.grading.blocking import EngineAnswerBlocked, blocking, borrowed_answers
from engine.grading.chapters import get_exercise, registry
from engine.grading.core import (BLOCKED, ERROR, NOT_IMPLEMENTED, NOT_LOADED, STUCK, TAMPERED,
                                 WRONG,
                                 CheckFailed, CheckResult, Frame, Report,
                                 LocalImpl, keeping_rank_output)
from engine.grading.feedback import (frames_from_syntax_error, frames_from_text,
                                     frames_from_traceback, is_learner_file)
from engine.grading.learner import ExerciseLoadError, load_impl
from engine.launch import LaunchError, RankError, RankTimeoutError

# registry and get_exercise live with the chapters (engine.grading.chapters); here as before.
# check(), the notebook's, runs these in a child process with a time limit: it lives in
# engine.grading.isolated (engine.grading exports it).
__all__ = ["run_checks", "check_results", "check_impl", "registry", "get_exercise"]


def run_checks(name: str, impl: Callable | None = None, source: str = "exercises",
               root: str | Path | None = None) -> Report:
    """Run every check of exercise ``name`` against ``impl`` (default: the learner's file in
    ``<root>/<source>/``, see :func:`engine.grading.learner.load_impl`).

    While the file loads and the checks run, the engine's own answer to the exercise
    (``Exercise.blocks``) raises for the learner's code (:mod:`engine.grading.blocking`).
    """
    label = source if impl is None else "impl"
    return Report(get_exercise(name), label, list(check_results(name, impl, source, root)))


def check_results(name: str, impl: Callable | None = None, source: str = "exercises",
                  root: str | Path | None = None) -> Iterator[CheckResult]:
    """:func:`run_checks`, one :class:`CheckResult` at a time, each as soon as its check ends.

    This runs the learner's code in this process, through :class:`LocalImpl`, which passes
    arguments and results as a grading worker would (copied in, plain data out): the tests
    use it. The grader and the notebooks' ``check`` run it in a worker instead
    (:mod:`engine.grading.isolated`)."""
    exercise = get_exercise(name)
    check_impl(exercise, impl)
    with blocking(exercise):
        if impl is None:
            try:
                impl = load_impl(exercise, source, root)
            except ExerciseLoadError as e:
                yield from (_not_loaded(check_fn, e) for check_fn in exercise.checks)
                return
        borrowed = borrowed_answers(impl)
        if borrowed:
            yield from borrowed_results(exercise, borrowed)
            return
        local = LocalImpl(impl)
        for check_fn in exercise.checks:
            yield run_one(check_fn, local, lambda message: _written_where(impl, message))


def borrowed_results(exercise, borrowed: list[str]) -> list[CheckResult]:
    message = (f"{exercise.name} is being graded, and what it grades is the engine's "
               f"own answer ({', '.join(borrowed)}), imported instead of written; "
               "write it yourself")
    return [CheckResult(_name(check_fn), False, message, kind=BLOCKED)
            for check_fn in exercise.checks]


def check_impl(exercise, impl) -> None:
    """Refuse an ``impl=`` that cannot be graded: a function is needed unless the exercise
    grades a whole module."""
    if impl is not None and exercise.attr and not callable(impl):
        raise ValueError(f"impl must be a function, got {impl!r}")


def _name(check_fn: Callable) -> str:
    return check_fn.__name__.removeprefix("check_")


def _not_loaded(check_fn: Callable, e: ExerciseLoadError) -> CheckResult:
    if isinstance(e.error, SyntaxError):
        frames = frames_from_syntax_error(e.error)
    else:
        frames = frames_from_traceback(e.error.__traceback__) if e.error else ()
    return CheckResult(_name(check_fn), False, e.message, kind=NOT_LOADED, frames=frames)


def _first_line_after(text: str, prefix: str) -> str:
    line = text.splitlines()[0] if text else ""
    return line.removeprefix(prefix)


def _written_where(impl, message: str) -> tuple[Frame, ...]:
    """For a wrong answer, where the learner wrote what gave it: the graded function or class
    (for a module, those of its definitions the message names, else the file itself)."""
    if isinstance(impl, types.ModuleType):  # the definitions the message names, else all
        defined = [obj for obj in vars(impl).values()
                   if (inspect.isfunction(obj) or inspect.isclass(obj))
                   and obj.__module__ == impl.__name__ and not obj.__name__.startswith("_")]
        named = [obj for obj in defined if re.search(rf"\b{obj.__name__}\b", message)]
        named = named or defined
    else:
        named = [impl]
    frames = []
    for obj in named:
        try:
            lines, start = inspect.getsourcelines(obj)
            file = inspect.getsourcefile(obj) or ""
        except (OSError, TypeError):
            continue
        if file and is_learner_file(file):
            frames.append(Frame(file, start, obj.__name__, lines[0].strip()))
    return tuple(frames)


def run_one(check_fn: Callable, impl, written_where: Callable[[str], tuple]) -> CheckResult:
    """Run one check on ``impl`` (:class:`LocalImpl` or
    :class:`engine.grading.remote.RemoteImpl`) and turn whatever happens into its result.
    ``written_where(message)``: the learner's definitions a wrong answer points at. A worker
    that died or ran out of time (:class:`engine.grading.remote.WorkerGone`) is raised on:
    the exercise ends there."""
    from engine.grading.remote import RemoteError, Tampered, Unsendable, WorkerGone

    name = _name(check_fn)
    with keeping_rank_output() as output:
        try:
            note = check_fn(impl)  # a passing check may return passed(...)'s line
            return CheckResult(name, True, note=note if isinstance(note, str) else "")
        except WorkerGone:
            raise
        except CheckFailed as e:
            result = CheckResult(name, False, e.message, e.inputs, kind=WRONG,
                                 frames=written_where(e.message))
        except Tampered as e:
            result = CheckResult(name, False, f"your code changed the grader's world: {e} "
                                 "(leave torch, the meter and the grader as they are)",
                                 kind=TAMPERED)
        except Unsendable as e:
            result = CheckResult(name, False, f"what your code returned cannot be graded: {e}",
                                 kind=ERROR)
        except NotImplementedError as e:  # the learner's function, called in this process
            result = CheckResult(name, False, "not implemented yet", kind=NOT_IMPLEMENTED,
                                 frames=_frames(e))
        except EngineAnswerBlocked as e:
            result = CheckResult(name, False, str(e), kind=BLOCKED, frames=_frames(e))
        except RankError as e:
            frames = frames_from_text(e.traceback)
            if e.exc_type == "NotImplementedError":
                result = CheckResult(name, False, "not implemented yet", kind=NOT_IMPLEMENTED,
                                     ranks=(e.rank,), frames=frames)
            elif e.exc_type == EngineAnswerBlocked.__name__:
                result = CheckResult(name, False, _first_line_after(
                    str(e), f"rank {e.rank} raised {e.exc_type}: "), kind=BLOCKED,
                    ranks=(e.rank,), frames=frames)
            else:
                result = CheckResult(name, False, _first_line_after(str(e), f"rank {e.rank} "),
                                     kind=ERROR, ranks=(e.rank,), frames=frames)
        except RankTimeoutError as e:
            result = CheckResult(name, False, "never finished: is every send matched by a "
                                 "receive on the peer, in the same order?", kind=STUCK,
                                 ranks=tuple(e.ranks), frames=frames_from_text(str(e)))
        except LaunchError as e:
            result = CheckResult(name, False, _first_line_after(str(e), f"rank {e.rank} "),
                                 kind=ERROR, ranks=tuple(e.ranks))
        except RemoteError as e:
            result = CheckResult(name, False, f"{e.types[0] if e.types else 'Exception'}: "
                                 f"{e.message}", kind=ERROR, frames=_frames(e))
        except Exception as e:  # noqa: BLE001 - the learner's code raised in this process
            result = CheckResult(name, False, f"{type(e).__name__}: {e}", kind=ERROR,
                                 frames=_frames(e))
    result.output = "\n".join(output)
    return result


def _frames(e: BaseException) -> tuple[Frame, ...]:
    """The learner's lines in ``e``'s traceback: as text when it was raised in the grading
    worker, else from the live traceback."""
    remote = getattr(e, "remote_traceback", None)
    return frames_from_text(remote) if remote is not None else \
        frames_from_traceback(e.__traceback__)
