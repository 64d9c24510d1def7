"""The one reader of argument values on the Python side: every public function of the
package (``remat.plan``, ``remat.reshard``, ``remat.torch.auto_checkpoint``) turns a
value into the text the ``remat`` command would be given and reads it with the same Rust
reader (``remat_units``, through ``remat._native``), so that one value gets one message
and one exception class from every front end: ``ArgumentError``, whose message is the
command's after the flag's name (``--budget 0: ...`` there, ``budget 0: ...`` here).

A value of the wrong type is an ``ArgumentError`` too, naming the argument and the types
it takes.
"""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any

from . import _native
from .errors import ArgumentError

__all__ = ["budget_text", "check_step_budget", "bandwidth", "seconds", "count", "size"]


def _number_text(value: float) -> str:
    """A float as the command line would write it: its shortest decimal, without an
    exponent and with a point (``0.7``, ``32000000000.0``); ``inf`` / ``nan`` as such."""
    if not math.isfinite(value):
        return repr(value)
    text = format(Decimal(repr(value)), "f")
    return text if "." in text else text + ".0"


def budget_text(value: Any, name: str) -> str:
    """``value`` as budget text: an int is bytes (``"1024"``), a float a fraction
    (``"0.5"``), a str as given.

    >>> budget_text(0.5, "budget"), budget_text(8 << 30, "budget")
    ('0.5', '8589934592')
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ArgumentError(
            f'{name}: give bytes (int), a fraction (float) or text ("8GiB"), '
            f"not {type(value).__name__}",
            argument=name, value=value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _number_text(value)
    return value


def check_step_budget(value: Any, name: str = "memory_budget") -> None:
    """Refuses, when it is given, a budget for a training step that cannot be meant:
    unreadable text, 0, a negative number, a fraction outside (0, 1], or bytes under
    1 KiB (no step fits; ``1`` meant ``1.0`` or ``"1GiB"``), as ``remat train
    --memory-budget`` refuses them.

    >>> check_step_budget("8GiB")
    >>> check_step_budget(1)
    Traceback (most recent call last):
    ...
    remat.errors.ArgumentError: memory_budget 1: 1 byte cannot hold a training step (a budget in bytes is at least 1 KiB); did you mean a fraction (1.0) or a size (1GiB)?
    """
    _native.check_budget(budget_text(value, name), name)


def bandwidth(value: Any, name: str = "bandwidth") -> float:
    """Bytes per second from a number or text (``"32GB/s"``), at least 1 B/s.

    >>> bandwidth("32GB/s"), bandwidth(1e9)
    (32000000000.0, 1000000000.0)
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ArgumentError(
            f'{name}: give bytes per second (a number) or text ("32GB/s"), '
            f"not {type(value).__name__}",
            argument=name, value=value)
    text = _number_text(value) if isinstance(value, float) else str(value)
    return _native.parse_bandwidth(text, name)


def seconds(value: Any, name: str, maximum: int = 1_000_000) -> float:
    """Seconds above 0 and at most ``maximum``, from a number.

    >>> seconds(0.5, "time_limit")
    0.5
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentError(f"{name}: give seconds (a number), not {type(value).__name__}",
                            argument=name, value=value)
    text = _number_text(value) if isinstance(value, float) else str(value)
    return _native.parse_seconds(text, name, maximum)


def count(value: Any, name: str, minimum: int = 1) -> int:
    """A whole number of at least ``minimum`` (1 where 0 would do nothing).

    >>> count(3, "world_size")
    3
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentError(f"{name}: give a whole number (int), not {type(value).__name__}",
                            argument=name, value=value)
    return _native.parse_count(str(value), name, minimum)


def size(value: Any, name: str, *, nonzero: bool = False) -> int:
    """Bytes from an int or text (``"256MiB"``); with ``nonzero``, at least 1 byte.

    >>> size("1KiB", "max_buffer", nonzero=True)
    1024
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ArgumentError(
            f'{name}: give bytes (int) or text ("256MiB"), not {type(value).__name__}',
            argument=name, value=value)
    return _native.parse_size(str(value), name, nonzero)
