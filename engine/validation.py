"""The argument checks every strategy shares: one message shape for every bad value.

Each check raises ``ValueError`` naming the argument, the value given and what was expected,
and returns the value so it can be used inline::

    self.degree = positive_int("tp", tp)
    divides("tp", tp, "num_heads", heads)

``bool`` is refused wherever a number is expected: ``True`` is an ``int`` to Python, but
``DataParallel(bucket_cap_mb=True)`` is a mistake, not a request for 1 MB.
"""

from __future__ import annotations

import argparse
import math
from typing import Iterable


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def positive_int(name: str, value) -> int:
    """``value`` if it is an int >= 1, else a ValueError naming ``name``."""
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def non_negative_int(name: str, value) -> int:
    """``value`` if it is an int >= 0, else a ValueError naming ``name``."""
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def positive_number(name: str, value) -> float:
    """``value`` if it is a finite int or float > 0, else a ValueError naming ``name``."""
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return value


def non_negative_number(name: str, value) -> float:
    """``value`` if it is a finite int or float >= 0, else a ValueError naming ``name``."""
    if not _is_number(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return value


def at_most(name: str, value, maximum, why: str = ""):
    """``value`` if it is <= ``maximum`` (checked for its type by one of the checks above
    first), else a ValueError naming ``name``, the maximum and ``why`` it is one."""
    if value > maximum:
        raise ValueError(f"{name} must be at most {_shown(maximum)}{why}, got {value!r}")
    return value


def at_least(name: str, value, minimum, why: str = ""):
    """``value`` if it is >= ``minimum``, else a ValueError naming ``name``, the minimum and
    ``why`` it is one."""
    if value < minimum:
        raise ValueError(f"{name} must be at least {_shown(minimum)}{why}, got {value!r}")
    return value


def _shown(bound) -> str:
    """A bound as a message writes it: 4,294,967,295; 86,400 (not 86,400.0); 0.5."""
    return f"{bound:,}" if _is_int(bound) else f"{bound:,g}"


def fraction(name: str, value, *, open_low: bool = True) -> float:
    """``value`` if it lies in (0, 1] (or [0, 1] with ``open_low=False``)."""
    low_ok = (value > 0) if open_low else (value >= 0)
    if not _is_number(value) or not (low_ok and value <= 1):
        bounds = "(0, 1]" if open_low else "[0, 1]"
        raise ValueError(f"{name} must be a number in {bounds}, got {value!r}")
    return value


def boolean(name: str, value) -> bool:
    """``value`` if it is ``True`` or ``False`` (not 1, not a string), else a ValueError."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def one_of(name: str, value, choices: Iterable):
    """``value`` if it is one of ``choices``, else a ValueError listing them."""
    choices = tuple(choices)
    if value not in choices or isinstance(value, bool) and not any(c is value for c in choices):
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; "
                         f"got {value!r}")
    return value


def divides(divisor_name: str, divisor: int, name: str, value: int) -> None:
    """Raise unless ``divisor`` divides ``value`` exactly (both named in the message)."""
    if value % divisor:
        raise ValueError(f"{divisor_name} = {divisor} must divide {name} = {value} "
                         f"({value} % {divisor} = {value % divisor})")


class ArgumentParser(argparse.ArgumentParser):
    """An ``argparse`` parser whose bad input is a ValueError naming it, not an exit: a notebook
    cell that calls a command gets an exception (``python -m engine train``, ``data``)."""

    def error(self, message):
        raise ValueError(message)
