"""The grader's side of a worker: start it, send it requests, read its answers as plain data,
and end it with everything it started.

:class:`RemoteImpl` stands for the learner's function in a check that runs in the grader's
process: calling it (or an attribute of it, for an exercise graded as a module) asks the worker
to call the real one, and :func:`engine.grading.core.run_ranks` and
:func:`engine.grading.core.run_here` send their driver to the worker when an argument is one.
What comes back is decoded by :mod:`engine.grading.wire` (JSON into exact types): the checks
compare it here, where no learner's code was ever imported.

A worker is started either forked from this process (:func:`start_forked`: a notebook's
``check``, where a function defined in a cell is graded) or as a fresh
``python -m engine.grading.worker`` inside the sandbox (:func:`start_sandboxed`, see
:mod:`engine.grading.sandbox`). Either way it leads a process group of its own, and when it is
ended every process it started is killed by PID (:mod:`engine.grading.processes`: the grader
is a child subreaper while it grades, so a daemon that detached itself with ``setsid`` and a
double fork is re-parented here, and found). The grader's own process group is never
signalled.
"""

from __future__ import annotations

import os
import pickle
import re
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from engine.grading import wire
from engine.grading.core import ImplProxy
from engine.grading.processes import kill_processes, my_children
from engine.grading.worker import HEADER, ImplSlot, send_message

OUTPUT_KEEP_BYTES = 16 * 1024  # what a worker printed, kept per exercise (the rest is counted)


class WorkerGone(Exception):
    """The worker did not answer: it died (``exitcode``) or ran past the deadline."""

    def __init__(self, timed_out: bool, exitcode: int | None):
        super().__init__("timed out" if timed_out else f"died (exit code {exitcode})")
        self.timed_out, self.exitcode = timed_out, exitcode


class Tampered(Exception):
    """The worker reports that the learner's code replaced part of torch, the meter or the
    grader (:class:`engine.grading.worker.Guard`)."""


class Unsendable(Exception):
    """What the learner's code returned cannot travel to the grader (not plain data)."""


class RemoteError(Exception):
    """Raised by the learner's code in the worker: ``types`` its class's MRO names,
    ``remote_traceback`` the traceback as text."""

    def __init__(self, types: list[str], message: str, remote_traceback: str):
        super().__init__(message)
        self.types, self.message, self.remote_traceback = types, message, remote_traceback


# Exceptions a check may expect from the learner's function (a bad input raises ValueError):
# one of the learner's is raised here as the first of these in its class's MRO.
_RAISABLE = {cls.__name__: cls for cls in (
    NotImplementedError, ValueError, TypeError, RuntimeError, AssertionError, KeyError,
    IndexError, ZeroDivisionError, AttributeError, ArithmeticError, LookupError,
    TimeoutError, OSError)}


def as_local_exception(raised: dict) -> BaseException:
    """The learner's exception, re-made here as a plain exception of the nearest built-in
    class (its remote traceback attached), or :class:`RemoteError`."""
    types = [t for t in raised.get("types", []) if type(t) is str]
    message = str(raised.get("message", ""))
    tb = str(raised.get("traceback", ""))
    from engine.grading.blocking import EngineAnswerBlocked
    if types and types[0] == EngineAnswerBlocked.__name__:
        error: BaseException = EngineAnswerBlocked(message)
    else:
        cls = next((_RAISABLE[t] for t in types if t in _RAISABLE), None)
        error = cls(message) if cls is not None else RemoteError(types, message, tb)
    error.remote_traceback = tb  # type: ignore[attr-defined]
    error.remote_types = types  # type: ignore[attr-defined]
    return error


# ------------------------------------------------------------------ what a worker printed

class _Output:
    """Reads what the worker and its ranks print, keeping the first :data:`OUTPUT_KEEP_BYTES`
    and counting the rest."""

    def __init__(self, fd: int):
        self.fd, self.kept, self.dropped = fd, bytearray(), 0
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            room = OUTPUT_KEEP_BYTES - len(self.kept)
            self.kept += chunk[:max(room, 0)]
            self.dropped += max(len(chunk) - max(room, 0), 0)
        os.close(self.fd)

    def text(self, wait: float = 1.0) -> str:
        self.thread.join(wait)
        text = self.kept.decode("utf-8", "replace")
        if self.dropped:
            text += f"\n[... {self.dropped} more bytes of output dropped]"
        return text


# ------------------------------------------------------------------ the worker's handle

@dataclass
class Worker:
    """A running worker: its process, its two pipes, what it printed, its deadline."""

    pid: int
    requests: int  # we write
    answers: int  # we read
    output: _Output
    deadline: float
    adopted_since: set[int]
    popen: subprocess.Popen | None = None
    hello: dict = field(default_factory=dict)
    exitcode: int | None = None
    timed_out: bool = False
    on_close: object = None  # called once everything is gone (the sandbox's scratch copy)

    def _read(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            wait = self.deadline - time.monotonic()
            if wait <= 0:
                self.timed_out = True
                raise WorkerGone(True, None)
            ready, _, _ = select.select([self.answers], [], [], wait)
            if not ready:
                continue
            chunk = os.read(self.answers, min(left, 1 << 20))
            if not chunk:
                raise WorkerGone(False, self.wait_exit())
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def receive(self) -> dict:
        size, = HEADER.unpack(self._read(HEADER.size))
        if size > wire.MAX_MESSAGE_BYTES:
            raise wire.WireError(f"an answer of {size} bytes is over the grader's limit of "
                                 f"{wire.MAX_MESSAGE_BYTES}")
        answer = wire.decode(self._read(size))
        if type(answer) is not dict:
            raise wire.WireError("an answer that is not a dict")
        return answer

    def request(self, op: str, **fields) -> tuple[object, list[str]]:
        """Send one request; the value it returned and the ranks' last lines of output.
        Raises what the learner's code raised (:func:`as_local_exception`), a launch error of
        its ranks, :class:`Tampered`, :class:`Unsendable` or :class:`WorkerGone`."""
        message = {"op": op, "seconds_left": self.deadline - time.monotonic(), **fields}
        try:
            send_message(self.requests, pickle.dumps(message))
        except (BrokenPipeError, OSError):
            raise WorkerGone(False, self.wait_exit()) from None
        answer = self.receive()
        output = [str(line) for line in answer.get("output", []) if type(line) is str]
        if "tampered" in answer:
            raise Tampered(str(answer["tampered"]))
        if "unsendable" in answer:
            raise Unsendable(str(answer["unsendable"]))
        if "raised" in answer and type(answer["raised"]) is dict:
            raise as_local_exception(answer["raised"])
        if "rank_error" in answer and type(answer["rank_error"]) is dict:
            raise rank_error(answer["rank_error"], output)
        if "value" not in answer:
            raise wire.WireError("an answer without a value")
        return answer["value"], output

    def wait_exit(self, wait: float = 0.5) -> int | None:
        end = time.monotonic() + wait
        while time.monotonic() < end:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return self.exitcode
            if pid:
                self.exitcode = os.waitstatus_to_exitcode(status)
                return self.exitcode
            time.sleep(0.01)
        return None

    def close(self) -> str:
        """End the worker and everything it started; what it printed."""
        try:
            send_message(self.requests, pickle.dumps({"op": "bye"}))
        except OSError:
            pass
        for fd in (self.requests, self.answers):
            try:
                os.close(fd)
            except OSError:
                pass
        self.wait_exit(0.2)
        kill_processes(self.pid, self.adopted_since)
        if self.popen is not None:
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        else:
            self.wait_exit(1.0)
        text = self.output.text()
        if callable(self.on_close):
            self.on_close()
        return text


def rank_error(info: dict, output: list[str]):
    """A launch error of the worker's ranks, re-made here from its data."""
    from engine.launch import LaunchError, RankDiedError, RankError, RankTimeoutError

    kind = info.get("kind")
    ranks = [r for r in info.get("ranks", []) if type(r) is int]
    message = str(info.get("message", ""))
    if kind == "RankError" and ranks:
        text = message.split("\n", 1)[0]
        prefix = f"rank {ranks[0]} raised {info.get('exc_type', '')}: "
        error: LaunchError = RankError(ranks[0], str(info.get("exc_type", "")),
                                       text.removeprefix(prefix), str(info.get("traceback", "")))
    elif kind == "RankTimeoutError":
        error = RankTimeoutError(message, ranks)
    elif kind == "RankDiedError":
        error = RankDiedError(message, ranks)
    else:
        error = LaunchError(message, ranks)
    error.output_tail = output  # type: ignore[attr-defined]
    return error


class RemoteImpl(ImplProxy):
    """The learner's function, in a check running in the grader: calling it asks the worker.
    For an exercise graded as a module, its attributes are the module's functions."""

    def __init__(self, worker: Worker, attr: str = ""):
        self._worker, self._attr = worker, attr

    def __call__(self, *args, **kwargs):
        value, _ = self._worker.request("call", attr=self._attr, args=args, kwargs=kwargs)
        return value

    def __getattr__(self, name: str):
        if name.startswith("__") or self._attr:
            raise AttributeError(name)
        return RemoteImpl(self._worker, name)

    def slot(self) -> ImplSlot:
        return ImplSlot(self._attr)

    def worker(self) -> Worker:
        return self._worker

    def __repr__(self) -> str:
        return f"<the learner's {self._attr or 'function'}, in the grading worker>"


# ------------------------------------------------------------------ starting a worker

def _pipes() -> tuple[int, int, int, int]:
    req_r, req_w = os.pipe()
    ans_r, ans_w = os.pipe()
    return req_r, req_w, ans_r, ans_w


def start_forked(name: str, source: str, root: str | None, impl, timeout: float) -> Worker:
    """A worker forked from this process (``impl``, if given, passes through the fork)."""
    from engine.grading.worker import run

    req_r, req_w, ans_r, ans_w = _pipes()
    out_r, out_w = os.pipe()
    adopted = my_children()
    for stream in (sys.stdout, sys.stderr):  # the worker starts with nothing left to print
        stream.flush()
    pid = os.fork()
    if pid == 0:  # the worker
        try:
            os.setpgid(0, 0)
            from engine.launch import die_with_parent
            die_with_parent()
            os.dup2(out_w, 1)
            os.dup2(out_w, 2)
            for fd in (req_w, ans_r, out_r, out_w):
                os.close(fd)
            sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
            run(name, source, root, impl, req_r, ans_w)
        finally:
            os._exit(0)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    for fd in (req_r, ans_w, out_w):
        os.close(fd)
    worker = Worker(pid, req_w, ans_r, _Output(out_r), time.monotonic() + timeout, adopted)
    return worker


def start_sandboxed(name: str, source: str, root: str, timeout: float, sandbox) -> Worker:
    """A fresh ``python -m engine.grading.worker`` inside ``sandbox``
    (:class:`engine.grading.sandbox.Sandbox`)."""
    req_r, req_w, ans_r, ans_w = _pipes()
    out_r, out_w = os.pipe()
    adopted = my_children()
    command = sandbox.command([sys.executable, "-c", "from engine.grading.worker import main; "
                               "main()", "--exercise", name, "--source", source, "--root", root,
                               "--requests", str(req_r), "--answers", str(ans_w)],
                              pass_fds=(req_r, ans_w))
    try:
        popen = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out_w, stderr=out_w,
                                 pass_fds=(req_r, ans_w), preexec_fn=sandbox.limits,
                                 env=sandbox.environment())
    except BaseException:
        sandbox.cleanup()
        raise
    finally:
        for fd in (req_r, ans_w, out_w):
            os.close(fd)
    return Worker(popen.pid, req_w, ans_r, _Output(out_r), time.monotonic() + timeout,
                  adopted, popen=popen, on_close=sandbox.cleanup)


# a line of faulthandler's dump: where the worker was when its time ran out
DUMPED_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<function>\S+)')
