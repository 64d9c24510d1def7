"""Exceptions of the remat package.

The Rust bindings raise these classes with the library's own message (the same text the
``remat`` command prints) and set the values at fault as attributes, so that code can act on
them without parsing the message.
"""

from __future__ import annotations

__all__ = [
    "RematError",
    "ArgumentError",
    "GraphError",
    "BudgetError",
    "PlanError",
    "OutputError",
    "ReshardError",
]


class RematError(Exception):
    """Base class of every remat error. Keyword arguments become attributes."""

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.message = message
        for key, value in details.items():
            setattr(self, key, value)

    def __str__(self) -> str:
        return self.message


class ArgumentError(RematError, ValueError):
    """An argument with a value remat cannot use (a bandwidth of 0, a world size of 0, an
    unknown format); the message names the argument."""


class GraphError(RematError, ValueError):
    """A graph that cannot be read. Attributes: ``file``, and ``node`` and ``field`` when
    the error is in one node's field (else None)."""

    file: str | None = None
    node: str | None = None
    field: str | None = None


class BudgetError(ArgumentError):
    """A budget that cannot be read, or that no plan fits. Attributes: ``budget_bytes``,
    ``floor_bytes`` (the graph's memory floor), ``best_peak`` (the smallest peak a strategy
    reached, when one did) and ``strategy`` (the one that reached it, or the one asked for)."""

    budget_bytes: int | None = None
    floor_bytes: int | None = None
    best_peak: int | None = None
    strategy: str | None = None


class PlanError(RematError):
    """A strategy that is unknown, does not apply, or failed. Attribute ``strategy``."""

    strategy: str | None = None


class OutputError(RematError, OSError):
    """An output path that cannot be written (checked before any work); nothing is written."""


class ReshardError(RematError):
    """A checkpoint that cannot be read, resharded or written. The message names the file
    or tensor at fault."""
