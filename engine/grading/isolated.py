"""One exercise graded with the learner's code in a worker and the verdicts here, with a time
limit: a learner's ``while True`` fails that exercise, and grading goes on. The grader's
command line grades each exercise so, and so does the notebook's :func:`check`.

:func:`run_isolated` starts a worker (:mod:`engine.grading.worker`: forked from here, or in
the sandbox the command line builds, :mod:`engine.grading.sandbox`) that loads the learner's
file, and runs the exercise's checks here with a :class:`engine.grading.remote.RemoteImpl`
standing for the learner's function: every call, driver and rank the checks start that needs
the learner's code runs in the worker, and only plain data comes back, compared here. This
process never imports the learner's file; what the learner's code patches in the worker
(``torch.equal``, the meter, a check's function) cannot change a comparison made here.

Past the time limit the worker is killed with everything it started (by PID: every process
under it, and every orphan this process adopted as a child subreaper, ``setsid`` daemons
included), the checks that finished keep their verdicts, the one running fails with "took
longer than N s" and the line the code was looping on (faulthandler's dump, armed in the
worker before each request), and those not reached fail saying so. A worker that dies without
a word (``os._exit``, a segfault) fails the check it was running the same way. What the
worker printed is kept on the report, cleaned of control characters and capped.
"""

from __future__ import annotations

import ast
import linecache
import re
from pathlib import Path
from typing import Callable

from engine.grading.chapters import get_exercise
from engine.grading.core import ERROR, NOT_LOADED, STUCK, CheckResult, Frame, Report
from engine.grading.feedback import (clean_text, format_report, frames_from_text,
                                     is_learner_file, printed_text)
from engine.grading.learner import course_root, exercise_path
from engine.grading.progress import Attempts, check_hint_level
from engine.grading.processes import Subreaper
from engine.grading.remote import (DUMPED_FRAME, RemoteImpl, WorkerGone, start_forked,
                                   start_sandboxed)
from engine.grading.runner import borrowed_results, check_impl, run_one
from engine.grading.wire import WireError

# The slowest exercise on the reference solutions (ch03.topk_error_feedback) took 6.5 s on a
# busy 2-core CPU machine, ch00 and ch02.overlap_hook about 6 s, most under 3 s (measured with
# run_checks). The default leaves three times that, for slower machines.
SLOWEST_SOLUTION_S = 6.5
DEFAULT_TIMEOUT_S = 20.0


def _unfinished(name: str, message: str, frames: tuple[Frame, ...] = ()) -> CheckResult:
    return CheckResult(name, False, message, kind=STUCK, frames=frames)


def _written_in(path: Path | None, attr: str, message: str) -> tuple[Frame, ...]:
    """For a wrong answer, where the learner wrote what gave it, read from the file's text (the
    grader never imports it): the graded function, or for a module the definitions the
    message names, else all of them."""
    if path is None or not path.is_file():
        return ()
    try:
        text = path.read_text(errors="replace")
        tree = ast.parse(text)
    except (OSError, SyntaxError, ValueError):
        return ()
    lines = text.splitlines()
    defined = [node for node in tree.body
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
               and not node.name.startswith("_")]
    if attr:
        named = [node for node in defined if node.name == attr]
    else:
        named = [n for n in defined if re.search(rf"\b{n.name}\b", message)] or defined
    return tuple(Frame(str(path), node.lineno, node.name,
                       lines[node.lineno - 1].strip() if node.lineno <= len(lines) else "")
                 for node in named)


def _load_failure(exercise, error: dict) -> list[CheckResult]:
    syntax = error.get("syntax")
    if type(syntax) is dict:
        frames = (Frame(str(syntax.get("file", "")), int(syntax.get("line", 0) or 0),
                        "<module>", str(syntax.get("text", ""))),)
    else:
        frames = frames_from_text(str(error.get("traceback", "")))
    return [CheckResult(fn.__name__.removeprefix("check_"), False, str(error.get("message", "")),
                        kind=NOT_LOADED, frames=frames) for fn in exercise.checks]


def where_it_was(output: str) -> tuple[Frame, ...]:
    """The learner's lines the worker was running when its time ran out (faulthandler's dump in
    what it printed), outermost first: where an endless loop loops."""
    dump = output[output.rfind("Timeout ("):] if "Timeout (" in output else ""
    frames = []
    for m in DUMPED_FRAME.finditer(dump):  # innermost first
        if is_learner_file(m["file"]) and not m["file"].startswith("<"):
            frames.append(Frame(m["file"], int(m["line"]), m["function"],
                                linecache.getline(m["file"], int(m["line"])).strip()))
    return tuple(reversed(frames))


def run_isolated(name: str, source: str = "exercises", root: str | Path | None = None,
                 timeout: float | None = None, impl: Callable | None = None,
                 sandbox=None) -> Report:
    """Grade exercise ``name`` with the learner's code in a worker (:mod:`engine.grading.worker`)
    and the checks here; past ``timeout`` seconds (default :data:`DEFAULT_TIMEOUT_S`), end the
    worker with everything it started and fail the checks not finished ("took longer than N
    s"). ``impl``: a function to grade instead of the file in ``<root>/<source>/`` (the worker
    is forked: it need not pickle). ``sandbox``: an :class:`engine.grading.sandbox.Sandbox` to
    start the worker in (the grader's command line's); else it is forked from here.
    What the worker printed is on the report (:attr:`Report.output`), cleaned and capped."""
    timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
    if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    exercise = get_exercise(name)
    check_impl(exercise, impl)
    check_names = [fn.__name__.removeprefix("check_") for fn in exercise.checks]
    root_text = None if root is None else str(Path(root).resolve())
    path = None if impl is not None else exercise_path(exercise, source, root)
    results: list[CheckResult] = []
    gone: WorkerGone | None = None
    with Subreaper():
        if sandbox is not None:
            if impl is not None:
                raise ValueError("a sandboxed worker grades files: impl= cannot be sent to it")
            worker = start_sandboxed(name, source, root_text or str(course_root(None)),
                                     timeout, sandbox)
        else:
            worker = start_forked(name, source, root_text, impl, timeout)
        try:
            try:
                hello = worker.receive()
            except (WorkerGone, WireError) as e:
                gone = e if isinstance(e, WorkerGone) else WorkerGone(False, None)
                hello = {}
            if gone is None and "load_error" in hello:
                results = _load_failure(exercise, hello["load_error"]
                                        if type(hello["load_error"]) is dict else {})
            elif gone is None and hello.get("borrowed"):
                results = borrowed_results(exercise, [str(b) for b in hello["borrowed"]])
            elif gone is None:
                remote = RemoteImpl(worker)
                for check_fn in exercise.checks:
                    try:
                        results.append(run_one(check_fn, remote, lambda message: _written_in(
                            path, exercise.attr, message)))
                    except WorkerGone as e:
                        gone = e
                        break
                    except WireError as e:
                        results.append(CheckResult(check_names[len(results)], False,
                                                   f"the grading worker sent what the grader "
                                                   f"does not accept ({e})", kind=ERROR))
        finally:
            output = clean_text(worker.close())
    if len(results) < len(check_names):
        running = check_names[len(results)]
        if gone is not None and gone.timed_out:
            why = (f"took longer than {timeout:g} s, the time limit of one exercise (a loop "
                   "that never ends, or ranks waiting for a message that never comes?)")
            skipped = f"not run: {running} took longer than {timeout:g} s before it"
            frames = where_it_was(output)
        else:
            code = None if gone is None else gone.exitcode
            why = f"the grading process died (exit code {code}) during this check"
            skipped = f"not run: the grading process died during {running}"
            frames = ()
        results.append(_unfinished(running, why, frames))
        results += [_unfinished(rest, skipped) for rest in check_names[len(results):]]
    return Report(exercise, source if impl is None else "impl", results, output=output)


def check(name: str, impl: Callable | None = None, hint: int | None = None,
          timeout: float | None = None) -> None:
    """Grade exercise ``name`` and print the result (use :func:`engine.grading.run_checks`
    for the data).

    Without ``impl`` the function in ``exercises/<module>.py`` is graded (read afresh, so save
    the file first); pass ``impl=my_function`` to grade one defined in the notebook instead.
    The checks run in a child process (:func:`run_isolated`): past ``timeout`` seconds
    (default :data:`DEFAULT_TIMEOUT_S`, the grader's command line's too) the exercise fails
    with "took longer than N s" and the line the code was looping on. Each failed attempt of
    code that runs reveals one more hint (the idea, the API to use, the shape of the code);
    ``hint=2`` asks for the first two now. Attempts are saved beside the drill's scores
    (:mod:`engine.grading.progress`).
    """
    asked = check_hint_level(hint)
    report = run_isolated(name, impl=impl, timeout=timeout)
    attempts = Attempts()
    level = attempts.record(report, asked)
    attempts.save()
    printed = printed_text(report.output)
    if printed.strip():  # print debugging works: what the code printed, then the verdict
        print(printed.rstrip("\n"))
    print(format_report(report, hint_level=level, printed=False))
