"""What an exercise and a check result are, and how a check runs ranks.

A check is a function ``check_<what>(impl)`` that raises :class:`CheckFailed` (saying what was
expected, what was observed, and on which input) or returns, with :func:`passed`'s line when
it measured something: the report prints it beside the check's ✓. It starts ranks through
:func:`run_ranks`, which always uses Gloo on the CPU (the checks' tensors live there, even on a
GPU machine) and keeps what the ranks printed, so a failure can show it.
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from engine.grading import wire
from engine.launch import launch

OUTPUT_TAIL_LINES = 12  # the last lines of the ranks' output a failure shows
# The meter's names for point-to-point ops. A collective called through engine.comm.ops is
# counted on the wire too, so an exercise that must build one from sends checks these names.
POINT_TO_POINT = frozenset({"send", "recv", "isend", "irecv"})


def passed(measured: str, formula: str, **at: Any) -> str:
    """What a passing check returns, shown after its ✓ in one line: the measured quantity
    beside the formula it matches, ``passed("sent 1.50 x S", "2(N-1)/N", N=4)`` ->
    ``"sent 1.50 x S = 2(N-1)/N at N = 4"``."""
    where = ", ".join(f"{name} = {value}" for name, value in at.items())
    return f"{measured} = {formula}" + (f" at {where}" if where else "")


class CheckFailed(AssertionError):
    """Raised by a check: ``message`` says what was wrong, ``inputs`` what it was given."""

    def __init__(self, message: str, **inputs: Any):
        super().__init__(message)
        self.message = message
        self.inputs = inputs


HINT_LEVELS = ("the idea", "the API to use", "the shape of the code")
# How to ask for the next hint: in a notebook, and from the terminal (python -m engine.grading)
HINT_IN_NOTEBOOK = 'check("{name}", hint={level})'
HINT_IN_TERMINAL = "python -m engine.grading --only {name} --hint {level}"


@dataclass(frozen=True)
class Exercise:
    """One exercise: where the learner's code lives, the checks that grade it, three hints and
    the engine's own answers that are switched off while it is graded.

    ``hints`` are revealed one level per failed attempt (see :data:`HINT_LEVELS`): 1 the idea,
    2 the API to use, 3 the shape of the code. ``blocks`` are dotted paths of the engine's own
    implementations of what the exercise asks (``"engine.comm.ring.ring_all_reduce"``): while
    the exercise is graded each raises an error saying so, wherever it was imported from.
    """

    name: str  # "ch00.p2p_broadcast": chapter prefix, then the exercise
    module: str  # the module in exercises/ and solutions/, e.g. "ch00_p2p_broadcast"
    attr: str  # the function the learner writes, e.g. "p2p_broadcast"; "" grades the module
    checks: tuple[Callable[[Callable], None], ...]
    hints: tuple[str, str, str]
    blocks: tuple[str, ...] = ()
    title: str = ""

    def __post_init__(self):
        if (not isinstance(self.hints, tuple) or len(self.hints) != len(HINT_LEVELS)
                or not all(isinstance(h, str) and h.strip() for h in self.hints)):
            raise ValueError(f"{self.name}: hints must be {len(HINT_LEVELS)} non-empty strings "
                             f"({', '.join(HINT_LEVELS)}), got {self.hints!r}")
        if not isinstance(self.blocks, tuple) or not all(
                isinstance(b, str) and b.startswith("engine.") and b.count(".") >= 2
                for b in self.blocks):
            raise ValueError(f"{self.name}: blocks must be a tuple of dotted paths inside the "
                             f"engine (\"engine.comm.ring.ring_all_reduce\"), got {self.blocks!r}")

    @property
    def chapter(self) -> str:
        return self.name.split(".")[0]


class Frame(NamedTuple):
    """One line of the learner's code on the way to an error."""

    file: str
    line: int
    function: str
    code: str


# What went wrong, from the learner's point of view.
PASSED, NOT_IMPLEMENTED, WRONG, ERROR, NOT_LOADED, STUCK, BLOCKED, TAMPERED = (
    "passed", "not implemented", "wrong", "error", "not loaded", "stuck",
    "uses the engine's answer", "tampered")
NOT_STARTED = (NOT_IMPLEMENTED, NOT_LOADED)  # no hint for these: the code does not run yet


@dataclass
class CheckResult:
    name: str
    passed: bool
    message: str = ""
    inputs: dict = field(default_factory=dict)
    kind: str = PASSED  # one of the constants above
    ranks: tuple[int, ...] = ()  # the rank(s) the failure happened on; () for the caller
    frames: tuple[Frame, ...] = ()  # the learner's own lines on the way to the error
    output: str = ""  # the last lines the ranks printed
    note: str = ""  # a passing check's measurement beside its formula (see passed())

    @property
    def not_implemented(self) -> bool:
        return self.kind == NOT_IMPLEMENTED


@dataclass
class Report:
    exercise: Exercise
    source: str
    results: list[CheckResult]
    output: str = ""  # what the grading worker printed (cleaned, capped); "" when run here

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def score(self) -> tuple[int, int]:
        return sum(r.passed for r in self.results), len(self.results)


# The output of the ranks a check started most recently; set by the runner around each check.
_rank_output: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "rank_output", default=None)


class ImplProxy:
    """What a check gets as ``impl``: the learner's function behind a proxy that passes
    arguments and results as a grading worker does. :meth:`worker` is the worker it lives in
    (:class:`engine.grading.remote.RemoteImpl`), or None when it lives here
    (:class:`LocalImpl`); :meth:`slot` is what a driver's arguments carry in its place."""

    def worker(self):
        return None

    def slot(self):
        raise NotImplementedError


class LocalImpl(ImplProxy):
    """The learner's function called in this process as a grading worker would call it: the
    arguments copied in (a pickle round trip: changes made to them are not seen), the result
    sent back as plain data (:func:`engine.grading.wire.roundtrip`). For an exercise graded
    as a module, its attributes are the module's functions, called the same way. The drivers
    of :func:`run_ranks` and :func:`run_here` get the function itself."""

    def __init__(self, impl, attr: str = ""):
        self.impl, self.attr = impl, attr

    def __call__(self, *args, **kwargs):
        args, kwargs = pickle.loads(pickle.dumps((args, kwargs)))
        return wire.roundtrip(self.slot()(*args, **kwargs))

    def __getattr__(self, name: str):
        if name.startswith("__") or self.attr or callable(self.impl):
            raise AttributeError(name)
        return LocalImpl(self.impl, name)

    def slot(self):
        return getattr(self.impl, self.attr) if self.attr else self.impl


def _remote(args: tuple):
    """The grading worker the learner's function lives in, if it is among ``args`` and not
    here; else None."""
    return next((a.worker() for a in args if isinstance(a, ImplProxy) and a.worker()), None)


def _slots(args: tuple) -> tuple:
    """``args`` with each proxy replaced by what a driver gets in its place."""
    return tuple(a.slot() if isinstance(a, ImplProxy) else a for a in args)


def _keep_output(lines: list[str]) -> None:
    kept = _rank_output.get()
    if kept is not None:
        kept[:] = lines[-OUTPUT_TAIL_LINES:]


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 20) -> list[Any]:
    """``engine.launch(fn, world_size, *args)`` on Gloo, keeping the ranks' output for the report.

    The output is neither lost nor printed: the runner shows its last lines if the check fails.
    ``fn`` is a driver (a module-level function of the check's chapter): what it returns comes
    back as plain data (:func:`engine.grading.wire.roundtrip`), so compare it in the check,
    never inside ``fn``. When the learner's function is among ``args`` and the check runs in
    the grader (:mod:`engine.grading.remote`), the ranks are started in the grading worker and
    only their return values come back.
    """
    worker = _remote(args)
    if worker is not None:
        try:
            values, output = worker.request("ranks", fn=fn, world_size=world_size,
                                            args=_slots(args), timeout=timeout)
        except Exception as e:
            _keep_output(getattr(e, "output_tail", []))
            raise
        _keep_output(output)
        return values
    args = _slots(args)
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):  # launch prints each rank's output at the end
            return wire.roundtrip(launch(fn, world_size, *args, backend="gloo",
                                         timeout=timeout))
    finally:
        _keep_output(buffer.getvalue().splitlines())


def run_here(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` where the learner's code lives: in the grading worker when the
    learner's function is among the arguments as a :class:`engine.grading.remote.RemoteImpl`,
    else here. ``fn`` is a driver (a module-level function of the check's chapter) that builds
    what the learner's function needs (a model, hooks, state) and returns what it observed, as
    plain data (:mod:`engine.grading.wire`): compare it in the check, never inside ``fn``."""
    worker = _remote((*args, *kwargs.values()))
    kwargs = dict(zip(kwargs, _slots(tuple(kwargs.values()))))
    if worker is not None:
        value, _ = worker.request("run", fn=fn, args=_slots(args), kwargs=kwargs)
        return value
    return wire.roundtrip(fn(*_slots(args), **kwargs))


@contextlib.contextmanager
def keeping_rank_output():
    """Inside, :func:`run_ranks` leaves the last lines of its ranks' output in the yielded list."""
    kept: list[str] = []
    token = _rank_output.set(kept)
    try:
        yield kept
    finally:
        _rank_output.reset(token)
