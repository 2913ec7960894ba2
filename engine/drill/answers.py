"""Reading a drill answer the way people type it.

* Numbers with units: ``6 rounds``, ``175 MB``, ``2.9%``, ``0.5 s``, ``1.8B``. A unit of the
  asked dimension is converted (``0.18 GB`` for an answer in MB, ``175 MiB`` too: a MiB is
  2^20 bytes, an MB 10^6); a unit of another dimension, or a word that names no unit where a
  unit is asked, is not read.
* Arithmetic: ``4.5*1024``, ``2*7/8*100``, ``(8-1)/8``, ``2^20``, ``3 x 4``: evaluated from the
  syntax tree (numbers and + - * / ** only; no names, no calls), never with ``eval``.
* Hedged numbers: ``approx 1.88``, ``about 175 MB``, ``~1.88x``, ``≈ 1.88``, ``about ~2``: the
  hedge (``approx``, ``approximately``, ``about``, ``around``, ``roughly``, ``~``, ``≈``) is
  dropped and the number read; it is graded within the item's tolerance like any other.
* Letters: ``a``, ``A``, ``a)``, ``(a)``, ``A.``, ``a:``, and a letter followed by its option's
  text, ``a) whole heads``, ``b. the ring``, ``(c) something``: the letter decides.
* Yes or no: ``y``, ``yes``, ``n``, ``no``.

What cannot be read raises :class:`Unreadable`, whose message says what to type instead: the
drill asks the same item again and never grades it.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from dataclasses import dataclass


class Unreadable(ValueError):
    """An answer the drill could not read; the message says what to type."""


@dataclass(frozen=True)
class Unit:
    """The unit a numeric item asks for: ``scale`` in its dimension's base unit (bytes,
    seconds, FLOPs, bytes/s, a count, a ratio); ``asked`` and ``note`` are how the question
    says it."""

    name: str
    dimension: str
    scale: float
    asked: str
    note: str = ""


# Spellings read per dimension, lower-cased, with their scale in the dimension's base unit.
_SPELLINGS: dict[str, dict[str, float]] = {
    "bytes": {**{s: 1.0 for s in ("b", "byte", "bytes")},
              **{p + "b": 1000.0 ** i for i, p in enumerate("kmgtp", 1)},
              **{w + "bytes": 1000.0 ** i
                 for i, w in enumerate(("kilo", "mega", "giga", "tera", "peta"), 1)},
              **{p + "ib": 1024.0 ** i for i, p in enumerate("kmgtp", 1)}},
    "bandwidth": {**{p + "b/s": 1000.0 ** i for i, p in enumerate("kmgt", 1)},
                  **{p + "ib/s": 1024.0 ** i for i, p in enumerate("kmgt", 1)},
                  "b/s": 1.0, "bytes/s": 1.0},
    "time": {"s": 1.0, "sec": 1.0, "second": 1.0, "seconds": 1.0, "ms": 1e-3,
             "millisecond": 1e-3, "milliseconds": 1e-3, "us": 1e-6, "µs": 1e-6,
             "min": 60.0, "minute": 60.0, "minutes": 60.0, "h": 3600.0, "hour": 3600.0,
             "hours": 3600.0, "d": 86400.0, "day": 86400.0, "days": 86400.0},
    "flops": {**{p + s: 1000.0 ** i for i, p in enumerate(("", "k", "m", "g", "t", "p", "e"))
                 for s in ("flop", "flops")},
              **{w + s: 1000.0 ** i for i, w in enumerate(("tera", "peta", "exa"), 4)
                 for s in ("flop", "flops")}},
    "ratio": {"x": 1.0, "×": 1.0, "times": 1.0, "%": 0.01, "percent": 0.01, "psi": 1.0,
              "ψ": 1.0},
    "count": {"k": 1e3, "thousand": 1e3, "m": 1e6, "million": 1e6, "b": 1e9, "bn": 1e9,
              "billion": 1e9},
}

UNITS: dict[str, Unit] = {u.name: u for u in (
    Unit("B", "bytes", 1.0, "in bytes"),
    Unit("MB", "bytes", 1e6, "in MB", "10^6 bytes; a value in MiB or GB is converted"),
    Unit("GB", "bytes", 1e9, "in GB", "10^9 bytes; a value in GiB or MB is converted"),
    Unit("TB", "bytes", 1e12, "in TB", "10^12 bytes; a value in TiB or GB is converted"),
    Unit("GB/s", "bandwidth", 1e9, "in GB/s", "10^9 bytes per second"),
    Unit("ms", "time", 1e-3, "in ms", "a value in s or us is converted"),
    Unit("days", "time", 86400.0, "in days", "a value in hours is converted"),
    Unit("EFLOP", "flops", 1e18, "in exaFLOPs", "10^18 FLOPs"),
    Unit("%", "ratio", 0.01, "in percent", "82 and 82% both read as 82%"),
    Unit("fraction", "ratio", 1.0, "as a fraction", "0.25, 1/4 and 25% all read as 0.25"),
    Unit("x", "ratio", 1.0, "as a multiple", "1.5 and 1.5x both read"),
    Unit("billion", "count", 1e9, "in billions", "1.8 and 1.8B both read"),
    Unit("million", "count", 1e6, "in millions", "3.2 and 3.2M both read"),
)}


def unit(name: str) -> Unit:
    """The unit ``name`` names: one of :data:`UNITS`, or any other word, a count of those
    (``"rounds"``, ``"micro-batches"``)."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a numeric item's unit must be a non-empty string, got {name!r}")
    if name in UNITS:
        return UNITS[name]
    if any(name.lower() in spellings for dim, spellings in _SPELLINGS.items() if dim != "count"):
        raise ValueError(f"unit {name!r} names a measure; use one of {', '.join(UNITS)}")
    return Unit(name, "count", 1.0, f"in {name}")


# -- arithmetic ----------------------------------------------------------------------------------

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.Pow: operator.pow}
_SIGNS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64  # 2^20, 10^9 and 1024^4 read; 10^10^10 is not computed


MAX_LENGTH = 100  # characters of arithmetic read


def evaluate(expression: str) -> float:
    """The value of an arithmetic expression of numbers, + - * / ** and parentheses."""
    if len(expression) > MAX_LENGTH:
        raise Unreadable(f"longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):
        word = re.search(r"(?<![\d.])[^\W\d]\w*", expression)  # a word, not 1e3's e
        raise Unreadable(f"'{word[0]}' is not a number" if word
                         else "not a number or arithmetic") from None
    value = _value(tree.body)
    if not math.isfinite(value):
        raise Unreadable("not a finite number")
    return value


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        try:
            return float(node.value)
        except OverflowError:
            raise Unreadable("a number too large") from None
    if isinstance(node, ast.UnaryOp) and type(node.op) in _SIGNS:
        return _SIGNS[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise Unreadable(f"exponent {right:g} is too large")
        try:
            return _OPERATORS[type(node.op)](left, right)
        except (ZeroDivisionError, OverflowError):
            raise Unreadable("division by zero or overflow") from None
    raise Unreadable("only numbers and + - * / ^ ( ) are read")


# -- numbers with units --------------------------------------------------------------------------

# Words and signs that hedge a number ("approx 1.88", "~2x", "about ~175 MB"), at the start only.
_HEDGE = re.compile(r"^\s*(?:(?:approximately|approx\.?|about|around|roughly)(?![a-z])"
                    r"|~=|~|≈|≃)\s*", re.I)
_THOUSANDS = re.compile(r"(?<![\d.])(\d{1,3}(?:,\d{3})+)(?![\d,])")  # 4,608 -> 4608
_TIMES = re.compile(r"(?<=[\d.)])\s*[x×·]\s*(?=[\d.(])")  # 3 x 4 -> 3*4
# The unit: what follows the last digit, point or closing parenthesis.
_SPLIT = re.compile(r"^(?P<expr>.*[\d.)])\s*(?P<unit>[^\d.()]*)$", re.S)


def split_unit(text: str) -> tuple[float, str]:
    """``"4.5*1024 MiB"`` -> ``(4608.0, "MiB")``; ``"2.9%"`` -> ``(2.9, "%")``."""
    text = text.strip()
    while (hedge := _HEDGE.match(text)) and hedge.end():
        text = text[hedge.end():]
    text = text.replace("−", "-").replace("^", "**")
    text = _TIMES.sub("*", _THOUSANDS.sub(lambda m: m[1].replace(",", ""), text))
    match = _SPLIT.match(text)
    if not match:
        raise Unreadable("no number in it")
    expr, unit_text = match["expr"], match["unit"].strip()
    if re.search(r"[*/+\-]$", unit_text) or unit_text[:1] in ("*", "/", "+"):
        raise Unreadable("arithmetic after the unit is not read")
    return evaluate(expr), unit_text


def read_number(text: str, asked: Unit | str) -> float:
    """``text`` as a value in the unit ``asked``, converting a unit of the same dimension."""
    asked = asked if isinstance(asked, Unit) else unit(asked)
    value, unit_text = split_unit(text)
    return value * _scale(unit_text, asked) / asked.scale


def _scale(unit_text: str, asked: Unit) -> float:
    """The scale of ``unit_text`` in ``asked``'s dimension (``asked.scale`` when absent)."""
    if not unit_text:
        return asked.scale
    spellings = _SPELLINGS[asked.dimension]
    words = unit_text.split()
    for head in (unit_text, words[0]):
        if head.lower() in spellings:
            return spellings[head.lower()]
        if head.lower() in (asked.name.lower(), asked.name.lower().rstrip("s")):
            return asked.scale
    for dimension, others in _SPELLINGS.items():
        if dimension not in (asked.dimension, "count") and words[0].lower() in others:
            raise Unreadable(f"'{words[0]}' measures {_MEASURES[dimension]}; this answer is "
                             f"in {asked.name}")
    if asked.dimension == "count":
        return asked.scale  # a count: "6 rounds", "6 steps", "1.8 parameters"; a label
    raise Unreadable(f"'{unit_text}' is not a unit of {_MEASURES[asked.dimension]}")


_MEASURES = {"bytes": "data size", "bandwidth": "bandwidth", "time": "time", "flops": "FLOPs",
             "ratio": "a fraction or ratio", "count": "a count"}


# -- letters and yes/no --------------------------------------------------------------------------

# A letter alone ("a", "(a)", "A."), or followed by a mark and the option's text ("a) whole
# heads", "b. the ring", "(c) something"); a letter and text with no mark ("a guess") is not read.
_LETTER = re.compile(r"^\(?\s*([a-z])\s*(?:[).:]\s*(?:\S.*)?|-\s+\S.*)?$", re.I | re.S)


def read_letter(text: str, n_options: int) -> int:
    """The 0-based option index of a letter typed as ``a``, ``A``, ``a)``, ``(a)`` or ``A.``,
    alone or followed by the option's text (``a) whole heads``): the letter decides."""
    match = _LETTER.match(text.strip())
    if not match:
        raise Unreadable("not a letter")
    index = ord(match[1].lower()) - ord("a")
    if index >= n_options:
        raise Unreadable(f"there is no option {match[1].lower()}; the options are a to "
                         f"{chr(ord('a') + n_options - 1)}")
    return index


_YES, _NO = ("y", "yes", "yeah", "1", "true"), ("n", "no", "nope", "0", "false")


def read_yes_no(text: str) -> bool:
    word = text.strip().lower().rstrip(".!")
    if word in _YES or word in _NO:
        return word in _YES
    raise Unreadable("not y or n")


_EXAMPLES = {"B": "512 or 512 bytes", "MB": "175 or 175 MB", "GB": "2.5 or 2.5 GB",
             "TB": "2.8 or 2.8 TB", "GB/s": "10 or 10 GB/s", "ms": "0.5 or 0.5 ms",
             "days": "34 or 34 days", "EFLOP": "3.5 or 3.5e18 FLOPs", "%": "2.9 or 2.9%",
             "fraction": "0.25 or 1/4", "x": "1.5 or 1.5x", "billion": "1.8 or 1.8B",
             "million": "3.2 or 3.2M"}


def example(asked: Unit | str) -> str:
    """Two ways to type an answer in ``asked``, for the drill's "answer with ..." hint:
    ``175 or 175 MB``, ``1.5 or 1.5x``, ``6 or 6 rounds``."""
    asked = asked if isinstance(asked, Unit) else unit(asked)
    return _EXAMPLES.get(asked.name, f"6 or 6 {asked.name}")


def show(value: float, asked: Unit | str) -> str:
    """``value`` with its unit, as the drill prints it: ``175 MB``, ``82.7%``, ``1.5x``."""
    asked = asked if isinstance(asked, Unit) else unit(asked)
    number = f"{value:.4g}"
    if asked.name in ("%", "x"):
        return number + asked.name
    if asked.name == "fraction":
        return number
    return f"{number} {asked.name}"
