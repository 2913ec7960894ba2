"""The worker: the only process (with the ranks it starts) that runs a submission's code.

The grader (:mod:`engine.grading.remote`) starts one worker per exercise, forked (a notebook's
``check``) or as ``python -m engine.grading.worker`` inside a sandbox
(:mod:`engine.grading.sandbox`). The worker loads the learner's file with the engine's own
answers switched off for good (:func:`engine.grading.blocking.blocking` with ``hard=True``:
no stand-in keeps the original), then serves the grader's requests:

* ``call``: call the learner's function (or the module's ``attr``) with the arguments sent;
* ``run``: run a check's driver ``fn(impl, *args)`` here (a driver builds what a call needs:
  a model, an optimizer, hooks, and returns what it observed);
* ``ranks``: ``engine.launch(fn, world_size, ...)`` with the learner's function among the
  arguments, the ranks' return values and the end of what they printed.

Requests come from the grader as pickles (the grader trusts itself); every answer goes back
as JSON (:mod:`engine.grading.wire`), which the grader decodes into plain values and compares
in its own process. So a submission that patches ``torch.equal``, the meter or the check's own
functions here changes nothing the verdict is computed from but the data it sent. What is
counted here (the bytes the meter saw) could be forged by a submission that patches the meter;
:class:`Guard` notices the usual ways (a function of torch, ``torch.distributed``, the meter or
the grader replaced after the learner's file was loaded) and the answer says so, which fails
the exercise. A submission that also takes the guard apart is not caught by it: the README's
grading section says which checks are tamper-proof and which are not.
"""

from __future__ import annotations

import argparse
import faulthandler
import io
import os
import pickle
import signal
import struct
import sys
import traceback
import types
import warnings
from contextlib import redirect_stdout
from typing import Any, Callable

import torch

from engine.grading import wire

HEADER = struct.Struct("!Q")  # every message: its length, then that many bytes
OUTPUT_TAIL_LINES = 12


class ImplSlot:
    """Where the learner's function goes in a request's arguments (the grader has none)."""

    def __init__(self, attr: str = ""):
        self.attr = attr

    def __repr__(self) -> str:
        return f"<the learner's {self.attr or 'function'}>"


def send_message(fd: int, payload: bytes) -> None:
    view = memoryview(HEADER.pack(len(payload)) + payload)
    while view:
        view = view[os.write(fd, view):]


def read_exactly(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _exception(e: BaseException) -> dict:
    return {"types": [c.__name__ for c in type(e).__mro__],
            "message": _text(e), "traceback": "".join(traceback.format_exception(e))}


def _text(e: BaseException) -> str:
    try:
        return str(e)
    except Exception:  # noqa: BLE001 - a learner's exception whose __str__ raises
        return f"<{type(e).__name__} whose message cannot be shown>"


# ------------------------------------------------------------------ the guard against patching

# Modules whose functions a submission must leave alone: what the checks compare with, what
# counts the traffic, how the ranks talk, and the grader's own code.
_GUARDED_MODULES = ("builtins", "torch", "torch.distributed", "torch.distributed.distributed_c10d",
                    "torch.nn.functional", "engine.comm", "engine.observe.meter", "engine.comm.ops",
                    "engine.comm.p2p", "engine.launch", "engine.grading.core",
                    "engine.grading.wire", "engine.grading.worker")
_GUARDED_CLASSES = (torch.Tensor, torch.nn.Module, torch.nn.Parameter)


def _guarded_modules() -> list[types.ModuleType]:
    names = set(_GUARDED_MODULES) | {n for n in sys.modules
                                     if n.startswith("engine.grading.chapters.")}
    return [sys.modules[n] for n in sorted(names) if n in sys.modules]


class Guard:
    """What the grader's side of this process looked like before the learner's code ran: every
    function and class in the guarded modules and classes, and each Python function's code.
    :meth:`changed` names the first one that differs now."""

    def __init__(self):
        self.seen = self._snapshot()

    @staticmethod
    def _snapshot() -> dict[tuple[str, str], tuple[int, int]]:
        with warnings.catch_warnings():  # reading a deprecated name warns
            warnings.simplefilter("ignore")
            return Guard._look()

    @staticmethod
    def _look() -> dict[tuple[str, str], tuple[int, int]]:
        seen = {}
        owners: list[tuple[str, dict]] = [(m.__name__, vars(m)) for m in _guarded_modules()]
        owners += [(f"{c.__module__}.{c.__qualname__}", vars(c)) for c in _GUARDED_CLASSES]
        meter = sys.modules.get("engine.observe.meter")
        if meter is not None:
            owners += [(f"engine.observe.meter.{name}", vars(obj)) for name, obj in vars(meter).items()
                       if isinstance(obj, type) and obj.__module__ == meter.__name__]
        for owner, namespace in owners:
            for name, value in list(namespace.items()):
                if callable(value) or isinstance(value, (staticmethod, classmethod, property)):
                    code = getattr(value, "__code__", None)
                    seen[(owner, name)] = (id(value), id(code))
        return seen

    def changed(self) -> str:
        now = self._snapshot()
        for key, before in self.seen.items():
            if now.get(key) != before:
                owner, name = key
                how = "removed" if key not in now else "replaced"
                return f"{owner}.{name} was {how}"
        return ""


_GUARD: Guard | None = None


def tampering() -> str:
    """What the learner's code replaced in this process, "" if nothing (see :class:`Guard`)."""
    return _GUARD.changed() if _GUARD is not None else ""


def _guarded_rank(rank, world_size, fn, *args):
    """A rank's body: the check's ``fn``, then the guard's look (inherited through the fork)."""
    value = fn(rank, world_size, *args)
    return {"value": value, "tampered": tampering()}


# ------------------------------------------------------------------ serving requests

class Worker:
    def __init__(self, impl, requests: int, answers: int):
        self.impl, self.requests, self.answers = impl, requests, answers

    def _args(self, args, kwargs):
        fill = self._fill
        return tuple(fill(a) for a in args), {k: fill(v) for k, v in kwargs.items()}

    def _fill(self, value):
        if isinstance(value, ImplSlot):
            return getattr(self.impl, value.attr) if value.attr else self.impl
        return value

    def handle(self, request: dict) -> dict:
        op = request["op"]
        args, kwargs = self._args(request.get("args", ()), request.get("kwargs", {}))
        if op == "call":
            target = self._fill(ImplSlot(request.get("attr", "")))
            return {"value": target(*args, **kwargs)}
        if op == "run":
            return {"value": request["fn"](*args, **kwargs)}
        if op == "ranks":
            return self._ranks(request["fn"], request["world_size"], args, request["timeout"])
        raise ValueError(f"unknown request {op!r}")

    def _ranks(self, fn: Callable, world_size: int, args: tuple, timeout: float) -> dict:
        from engine.launch import LaunchError, launch

        buffer = io.StringIO()
        try:
            with redirect_stdout(buffer):  # launch prints each rank's output at the end
                results = launch(_guarded_rank, world_size, fn, *args, backend="gloo",
                                 timeout=timeout)
        except LaunchError as e:
            return {"rank_error": {"kind": type(e).__name__, "message": _text(e),
                                   "ranks": list(e.ranks), "rank": e.rank,
                                   "exc_type": getattr(e, "exc_type", ""),
                                   "traceback": getattr(e, "traceback", "")},
                    "output": _tail(buffer.getvalue())}
        tampered = next((r["tampered"] for r in results if r["tampered"]), "")
        if tampered:
            return {"tampered": tampered, "output": _tail(buffer.getvalue())}
        return {"value": [r["value"] for r in results], "output": _tail(buffer.getvalue())}

    def serve(self) -> None:
        while True:
            try:
                size, = HEADER.unpack(read_exactly(self.requests, HEADER.size))
                request = pickle.loads(read_exactly(self.requests, size))  # from the grader
            except EOFError:
                return
            if request["op"] == "bye":
                return
            faulthandler.dump_traceback_later(max(request.get("seconds_left", 60) - 0.5, 0.1),
                                              exit=False, file=sys.stderr)
            try:
                answer = self.handle(request)
            except BaseException as e:  # noqa: BLE001 - the learner's code raised: send it
                answer = {"raised": _exception(e)}
            finally:
                faulthandler.cancel_dump_traceback_later()
            self.answer(answer)

    def answer(self, answer: dict) -> None:
        tampered = answer.get("tampered") or tampering()
        if tampered:
            answer = {"tampered": tampered, "output": answer.get("output", [])}
        try:
            payload = wire.encode(answer)
        except (wire.WireError, ValueError, TypeError, RecursionError) as e:
            payload = wire.encode({"unsendable": f"{e}"})
        send_message(self.answers, payload)


def _tail(text: str) -> list[str]:
    return text.splitlines()[-OUTPUT_TAIL_LINES:]


def load(name: str, source: str, root: str | None, impl) -> tuple[Any, dict]:
    """The learner's code, loaded with the engine's answers switched off for good; and the
    hello the grader gets (loaded, or why not)."""
    from engine.grading.blocking import blocking, borrowed_answers
    from engine.grading.chapters import get_exercise
    from engine.grading.learner import ExerciseLoadError, load_impl

    global _GUARD
    exercise = get_exercise(name)
    import torch._dynamo  # noqa: F401 - it wraps torch.manual_seed on import: before the look
    import engine.launch  # noqa: F401
    blocking(exercise, hard=True).__enter__()  # never left: this process ends after grading
    _GUARD = Guard()
    if impl is None:
        try:
            impl = load_impl(exercise, source, root)
        except ExerciseLoadError as e:
            error = e.error
            syntax = None
            if isinstance(error, SyntaxError):
                syntax = {"file": error.filename or "", "line": error.lineno or 0,
                          "text": (error.text or "").strip()}
            return None, {"load_error": {
                "message": e.message, "syntax": syntax,
                "traceback": "".join(traceback.format_exception(error)) if error else ""}}
    borrowed = borrowed_answers(impl)
    return impl, {"loaded": True, "borrowed": borrowed}


def run(name: str, source: str, root: str | None, impl, requests: int, answers: int) -> None:
    """The worker's whole life: load, say hello, serve until the grader says bye."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the grader's to handle
    torch.set_num_threads(1)  # OpenMP's pool, if the grader used it, does not survive a fork
    worker = Worker(None, requests, answers)
    try:
        impl, hello = load(name, source, root, impl)
    except BaseException as e:  # noqa: BLE001 - what the learner's module body did
        impl, hello = None, {"load_error": {"message": f"loading raised {type(e).__name__}",
                                            "syntax": None, "traceback": ""}}
    worker.impl = impl
    worker.answer(hello)
    if impl is not None:
        worker.serve()


def main(argv: list[str] | None = None) -> None:
    """``python -m engine.grading.worker``: the sandboxed worker (the grader passes the two
    pipes' file descriptors)."""
    cli = argparse.ArgumentParser(prog="python -m engine.grading.worker")
    cli.add_argument("--exercise", required=True)
    cli.add_argument("--source", default="exercises")
    cli.add_argument("--root", required=True)
    cli.add_argument("--requests", type=int, required=True)
    cli.add_argument("--answers", type=int, required=True)
    args = cli.parse_args(argv)
    from engine.grading.sandbox import install_audit_hook

    install_audit_hook()  # without bubblewrap: solutions/ and other students' files refused
    try:
        run(args.exercise, args.source, args.root, None, args.requests, args.answers)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - nothing left to show
                pass
        os._exit(0)


if __name__ == "__main__":
    main()
