"""What a learner sees when a check fails: their own lines, what the ranks printed, once.

* :func:`learner_frames` keeps, from a traceback (a rank's, as text, or one raised here), only
  the frames in the learner's code: every file outside the engine, the Python installation and
  its site-packages (an ``exercises/`` file, a notebook cell, a script).
* :func:`format_report` groups identical failures: one error seen by several checks, or on
  several ranks, is printed once with every check and rank it hit.
* Hints are shown up to the level asked for (:mod:`engine.grading.progress` decides: none
  while the exercise says "not implemented", then one more level per failed attempt).
"""

from __future__ import annotations

import re
import sysconfig
import textwrap
import traceback
from pathlib import Path
from types import TracebackType

from engine.grading.core import HINT_IN_NOTEBOOK, HINT_LEVELS, Frame, Report

_ENGINE = Path(__file__).resolve().parents[1]
_LIBRARY = {Path(p).resolve() for key in ("stdlib", "platstdlib", "purelib", "platlib")
            if (p := sysconfig.get_paths().get(key))}
# a frame of a formatted traceback, indented as traceback prints it or nested in another message
_FRAME_LINE = re.compile(r'^(?P<indent> *)File "(?P<file>[^"]+)", line (?P<line>\d+), '
                         r'in (?P<function>.+)$')
_ADDRESS = re.compile(r"\[[0-9a-fA-F.:]+\]:\d+")  # a peer's address in Gloo's errors, per run


def is_learner_file(file: str) -> bool:
    """True for code the learner wrote; False for the engine, Python itself and installed
    packages (torch)."""
    if file.startswith("<frozen"):
        return False
    path = Path(file)
    if {"site-packages", "dist-packages"} & set(path.parts):
        return False
    resolved = path.resolve() if path.is_absolute() else path
    return not any(resolved.is_relative_to(root) for root in (_ENGINE, *_LIBRARY))


def frames_from_text(tb_text: str) -> tuple[Frame, ...]:
    """The learner's frames in a traceback formatted by :mod:`traceback` (a rank's)."""
    frames, lines = [], tb_text.splitlines()
    for i, text in enumerate(lines):
        match = _FRAME_LINE.match(text)
        if not match or not is_learner_file(match["file"]):
            continue
        following = lines[i + 1] if i + 1 < len(lines) else ""
        deeper = len(following) - len(following.lstrip(" ")) > len(match["indent"])
        code = following.strip() if deeper and not _FRAME_LINE.match(following) else ""
        frames.append(Frame(match["file"], int(match["line"]), match["function"], code))
    return tuple(frames)


def frames_from_traceback(tb: TracebackType | None) -> tuple[Frame, ...]:
    """The learner's frames in a live traceback (code that raised in this process)."""
    return tuple(Frame(f.filename, f.lineno or 0, f.name, (f.line or "").strip())
                 for f in traceback.extract_tb(tb) if is_learner_file(f.filename))


def frames_from_syntax_error(e: SyntaxError) -> tuple[Frame, ...]:
    if not e.filename:
        return ()
    return (Frame(e.filename, e.lineno or 0, "<module>", (e.text or "").strip()),)


def _short(file: str) -> str:
    """A path as an editor or a terminal opens it from here: relative to the working directory
    when the file is under it, else absolute."""
    path = Path(file)
    if path.is_absolute() and path.is_relative_to(Path.cwd()):
        return str(path.relative_to(Path.cwd()))
    return file


# Every control character but newline and tab (terminal escapes, a bell, a window title), and
# what XML 1.0 cannot hold (lone surrogates, U+FFFE/U+FFFF).
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\ufffe\uffff]")


def clean_text(text: str, limit: int | None = None) -> str:
    """``text`` safe for a terminal and an XML file: control characters (an escape sequence's
    ESC, a carriage return) shown as ``\\xNN``; cut at ``limit`` characters with a note of
    how many were dropped."""
    text = _UNPRINTABLE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                            else f"\\u{ord(m.group()):04x}", str(text))
    if limit is not None and len(text) > limit:
        text = text[:limit] + f" [... {len(text) - limit} more characters dropped]"
    return text


_GREEN, _RED, _DIM, _RESET = "\033[32m", "\033[31m", "\033[2m", "\033[0m"


def _ranks(ranks: set[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}: "


def format_report(report: Report, color: bool = True, hint_level: int = 0,
                  hint_command: str = HINT_IN_NOTEBOOK, printed: bool = True) -> str:
    """PASS/FAIL and the score; each distinct failure once, with the checks and ranks it hit,
    the learner's lines that led to it, the inputs, and the end of what the ranks printed;
    then the exercise's hints from level 1 to ``hint_level`` and how to ask for the next one
    (``hint_command``: :data:`engine.grading.core.HINT_IN_NOTEBOOK` or ``HINT_IN_TERMINAL``)."""
    g, r, d, x = (_GREEN, _RED, _DIM, _RESET) if color else ("", "", "", "")
    got, total = report.score
    head = f"{report.exercise.name}: {got}/{total} checks passed"
    lines = [f"{g if report.passed else r}{'PASS' if report.passed else 'FAIL'}{x} {head}"]
    lines += [f"  {g}✓{x} {res.name}" + (f": {res.note}" if res.note else "")
              for res in report.results if res.passed]
    groups: dict[tuple, list] = {}
    for res in report.results:
        if not res.passed:
            key = (res.kind, _ADDRESS.sub("[address]", res.message), res.frames,
                   tuple((k, repr(v)) for k, v in res.inputs.items()))
            groups.setdefault(key, []).append(res)
    c = clean_text
    for (_, message, frames, _), members in groups.items():
        ranks = {rank for res in members for rank in res.ranks}
        names = ", ".join(res.name for res in members)
        lines.append(f"  {r}✗{x} {names}: {_ranks(ranks) if ranks else ''}"
                     f"{c(message, MESSAGE_CHARS)}")
        for frame in frames:
            lines.append(f"      {c(_short(frame.file))}, line {frame.line}, in "
                         f"{c(frame.function)}")
            if frame.code:
                lines.append(f"        {c(frame.code, MESSAGE_CHARS)}")
        for key, value in members[0].inputs.items():
            lines.append(f"      {d}{c(key)} = {c(repr(value), MESSAGE_CHARS)}{x}")
        output = next((res.output for res in members if res.output), "")
        if output:
            lines.append(f"      {d}the ranks printed (last lines):{x}")
            lines += [f"      {d}| {c(line, MESSAGE_CHARS)}{x}" for line in output.splitlines()]
    shown = printed_lines(report.output) if printed else []
    if shown and not report.passed:
        lines.append(f"  {d}your code printed (last lines):{x}")
        lines += [f"  {d}| {line}{x}" for line in shown]
    lines += hint_lines(report, hint_level, hint_command)
    return "\n".join(lines)


MESSAGE_CHARS = 2000  # one failure's message, a line of code or an input, as shown
PRINTED_LINES = 20


def printed_text(output: str) -> str:
    """All a grading worker printed (as kept: capped), cleaned, without faulthandler's dump:
    what a notebook's ``check`` shows before its report, as if the code had run there."""
    if "Timeout (" in output:
        output = output[:output.rfind("Timeout (")]
    return clean_text(output)


def printed_lines(output: str) -> list[str]:
    """The last lines a grading worker printed, cleaned, without faulthandler's dump of where
    it was when its time ran out (the report shows those lines already)."""
    if "Timeout (" in output:
        output = output[:output.rfind("Timeout (")]
    lines = [clean_text(line, 300) for line in output.splitlines() if line.strip()]
    dropped = next((line for line in lines if line.startswith("[... ")), None)
    tail = lines[-PRINTED_LINES:]
    if dropped and dropped not in tail:
        tail.append(dropped)
    return tail


def hint_lines(report: Report, level: int, hint_command: str = HINT_IN_NOTEBOOK) -> list[str]:
    """Hints 1 to ``level``, each with what it gives, and how to ask for the next one."""
    exercise, lines = report.exercise, []
    for i, (what, text) in enumerate(zip(HINT_LEVELS, exercise.hints[:level]), 1):
        lines += textwrap.wrap(text, 96, initial_indent=f"  hint {i} ({what}): ",
                               subsequent_indent="      ")
    if 0 < level < len(HINT_LEVELS) and not report.passed:
        ask = hint_command.format(name=exercise.name, level=level + 1)
        lines.append(f"  (next: {ask} for {HINT_LEVELS[level]})")
    return lines
