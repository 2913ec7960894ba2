"""One exercise graded in a child process with a time limit: a learner's ``while True`` fails
that exercise, and grading goes on. The grader's command line grades each exercise so, and so
does the notebook's :func:`check`: a check that calls the learner's function in this process
(not on ranks, which have their own timeout) could otherwise loop forever.

:func:`run_isolated` forks a child in its own process group that runs the exercise's checks
(:func:`engine.grading.runner.check_results`) and sends each result down a pipe as soon as its
check ends. Past the time limit the child is killed with everything it started (the ranks a
check launched sit in process groups of their own: each is killed too), the checks that
finished keep their verdicts, the one running fails with "took longer than N s" and those not
reached fail saying so. A child that dies without a word (``os._exit``, a segfault) fails the
check it was running the same way. Nothing the learner's code does in the child (a module
imported, an engine function swapped) reaches the grader; what it prints is printed.
"""

from __future__ import annotations

import faulthandler
import linecache
import multiprocessing as mp
import os
import re
import signal
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from engine.grading.chapters import get_exercise
from engine.grading.core import ERROR, STUCK, CheckResult, Frame, Report
from engine.grading.feedback import format_report, is_learner_file
from engine.grading.progress import Attempts, check_hint_level
from engine.grading.runner import check_impl, check_results
from engine.launch import die_with_parent

# The slowest exercise on the reference solutions (ch03.topk_error_feedback) took 6.5 s on a
# busy 2-core CPU machine, ch00 and ch02.overlap_hook about 6 s, most under 3 s (measured with
# run_checks). The default leaves three times that, for slower machines.
SLOWEST_SOLUTION_S = 6.5
DEFAULT_TIMEOUT_S = 20.0


class _Shown:
    """A value that could not be pickled, sent as its repr (a failure's inputs are only shown)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


# a line of faulthandler's dump: where the child was when the time ran out
_DUMPED_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<function>\S+)')


def _child(name: str, source: str, root: str | None, conn, stack_file: str, impl) -> None:
    os.setpgid(0, 0)  # our own group: the grader kills it, and whatever we started, at once
    die_with_parent()  # a grader killed outright (kill -9) leaves no endless loop behind
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the grader's to handle
    torch.set_num_threads(1)  # OpenMP's pool, if the grader used it, does not survive a fork
    dump = open(stack_file, "w")  # noqa: SIM115 - open until the child ends
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=False)
    try:
        for result in check_results(name, impl, source=source, root=root):
            try:
                conn.send(result)
            except Exception:  # noqa: BLE001 - an input that does not pickle is shown as text
                conn.send(replace(result, inputs={k: _Shown(repr(v))
                                                  for k, v in result.inputs.items()}))
    except Exception as e:  # noqa: BLE001 - the grader's own failure, not the learner's
        conn.send(f"the grader itself failed on this exercise: {type(e).__name__}: {e}")
    finally:
        conn.close()
        for stream in (sys.stdout, sys.stderr):  # what the learner's code printed here (the
            try:  # grader flushed its own before the fork, so nothing is printed twice)
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - a closed or odd stream: nothing to show
                pass
        os._exit(0)  # no atexit handlers


def descendants(pid: int) -> list[int]:
    """Every live process started, directly or not, by ``pid`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and the group of every process it started (a rank of
    :func:`engine.launch` leads a group of its own)."""
    groups = {pid}
    for child in descendants(pid):
        try:
            groups.add(os.getpgid(child))
        except ProcessLookupError:
            pass
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _unfinished(name: str, message: str, frames: tuple[Frame, ...] = ()) -> CheckResult:
    return CheckResult(name, False, message, kind=STUCK, frames=frames)


def where_it_was(pid: int, stack_file: str) -> tuple[Frame, ...]:
    """The learner's lines the child was running (faulthandler's dump on SIGUSR1), outermost
    first: where an endless loop loops."""
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        return ()
    text = ""
    for _ in range(40):  # written from the signal handler: wait until it stops growing
        time.sleep(0.05)
        now = Path(stack_file).read_text()
        if now.strip() and now == text:
            break
        text = now
    frames = []
    for m in _DUMPED_FRAME.finditer(text):  # innermost first, down to the child's own body
        if m["function"] == _child.__name__ and Path(m["file"]) == Path(__file__):
            break
        if not m["file"].startswith("<") and is_learner_file(m["file"]):
            frames.append(Frame(m["file"], int(m["line"]), m["function"],
                                linecache.getline(m["file"], int(m["line"])).strip()))
    return tuple(reversed(frames))


def run_isolated(name: str, source: str = "exercises", root: str | Path | None = None,
                 timeout: float | None = None, impl: Callable | None = None) -> Report:
    """Grade exercise ``name`` in a child process; past ``timeout`` seconds (default
    :data:`DEFAULT_TIMEOUT_S`), kill it with everything it started and fail the checks not
    finished ("took longer than N s"). ``impl``: a function to grade instead of the file in
    ``<root>/<source>/`` (the child is forked: it need not pickle)."""
    timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
    if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    exercise = get_exercise(name)
    check_impl(exercise, impl)
    check_names = [fn.__name__.removeprefix("check_") for fn in exercise.checks]
    ctx = mp.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)
    stack_fd, stack_file = tempfile.mkstemp(prefix="grade-stack-", suffix=".txt")
    os.close(stack_fd)
    child = ctx.Process(target=_child, name=f"grade-{name}",
                        args=(name, source, None if root is None else str(root), writer,
                              stack_file, impl))
    results: list[CheckResult] = []
    frames: tuple[Frame, ...] = ()
    for stream in (sys.stdout, sys.stderr):  # the child starts with nothing left to print
        stream.flush()
    deadline = time.monotonic() + timeout
    child.start()
    try:
        try:  # the child does this too: whoever is first closes the race with kill_tree
            os.setpgid(child.pid, child.pid)
        except OSError:
            pass
        writer.close()
        while len(results) < len(check_names):
            left = deadline - time.monotonic()
            if left <= 0 or not reader.poll(left):
                break
            try:
                received = reader.recv()
            except EOFError:  # the child died, or ended early
                break
            if isinstance(received, str):  # the grader's own error: fails what is left
                results += [CheckResult(rest, False, received, kind=ERROR)
                            for rest in check_names[len(results):]]
            else:
                results.append(received)
        timed_out = time.monotonic() >= deadline and len(results) < len(check_names)
        if timed_out:
            frames = where_it_was(child.pid, stack_file)
    finally:
        kill_tree(child.pid)
        child.join()
        reader.close()
        os.unlink(stack_file)
    if len(results) < len(check_names):
        running = check_names[len(results)]
        if timed_out:
            why = (f"took longer than {timeout:g} s, the time limit of one exercise (a loop "
                   "that never ends, or ranks waiting for a message that never comes?)")
            skipped = f"not run: {running} took longer than {timeout:g} s before it"
        else:
            why = f"the grading process died (exit code {child.exitcode}) during this check"
            skipped = f"not run: the grading process died during {running}"
        results.append(_unfinished(running, why, frames))
        results += [_unfinished(rest, skipped) for rest in check_names[len(results):]]
    return Report(exercise, source if impl is None else "impl", results)


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
    print(format_report(report, hint_level=level))
