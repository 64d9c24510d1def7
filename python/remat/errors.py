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
    """Base class of every remat error. Keyword arguments become attributes.

    >>> try:
    ...     remat.plan("step.json", "lots")
    ... except remat.RematError as err:
    ...     print(type(err).__name__, err.argument)
    ArgumentError budget
    """

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.message = message
        for key, value in details.items():
            setattr(self, key, value)

    def __str__(self) -> str:
        return self.message


class ArgumentError(RematError, ValueError):
    """An argument with a value remat cannot read or use, told before any work: text that
    is not a size, a zero or negative budget, a fraction above 1, a budget in bytes under
    1 KiB where a training step is budgeted, a bandwidth of 0, a world size of 0,
    ``max_buffer=0``, an unknown format, a value of the wrong type. The message is the one
    the ``remat`` command prints for the same value, the argument's name in place of the
    flag (``budget 0: ...`` for ``--budget 0: ...``). Attributes, where a value was read:
    ``argument`` (the name) and ``value`` (as given).

    >>> import remat
    >>> try:
    ...     remat.reshard("ckpt", "out", 0)
    ... except remat.ArgumentError as e:
    ...     print(e)
    world_size 0: must be at least 1
    """

    argument: str | None = None
    value: object = None


class GraphError(RematError, ValueError):
    """A graph that cannot be read. Attributes: ``file``, and ``node`` and ``field`` when
    the error is in one node's field (else None).

    >>> try:
    ...     remat.load_graph("missing.json")
    ... except remat.GraphError as err:
    ...     print(err.file)
    missing.json
    """

    file: str | None = None
    node: str | None = None
    field: str | None = None


class BudgetError(RematError, ValueError):
    """A budget that was read but that no plan fits (below the graph's memory floor, or
    every strategy's least peak above it); a budget that cannot be read at all is an
    :class:`ArgumentError`. Attributes: ``budget_bytes``, ``floor_bytes`` (the graph's
    memory floor), ``best_peak`` (the smallest peak a strategy reached, when one did) and
    ``strategy`` (the one that reached it, or the one asked for).

    >>> import remat
    >>> g = remat.Graph.from_json('{"format": "remat-graph", "version": 1, "name": "g", '
    ...     '"nodes": [{"name": "a", "phase": "forward", "compute_time": 1, '
    ...     '"output_bytes": 4096, "inputs": []}]}')
    >>> try:
    ...     remat.plan(g, 2048)
    ... except remat.BudgetError as e:
    ...     print(e.budget_bytes, e.floor_bytes)
    2048 4096
    """

    budget_bytes: int | None = None
    floor_bytes: int | None = None
    best_peak: int | None = None
    strategy: str | None = None


class PlanError(RematError):
    """A strategy that is unknown, does not apply, or failed. Attribute ``strategy``.

    >>> try:
    ...     remat.plan("step.json", 0.5, strategy="nope")
    ... except remat.PlanError as err:
    ...     print(err.strategy)
    nope
    """

    strategy: str | None = None


class OutputError(RematError, OSError):
    """An output path that cannot be written (checked before any work); nothing is written.

    >>> try:
    ...     remat.plan("step.json", 0.5).save("/nonexistent/dir/plan.json")
    ... except remat.OutputError as err:
    ...     print(type(err).__name__)
    OutputError
    """


class ReshardError(RematError):
    """A checkpoint that cannot be read, resharded or written. The message names the file
    or tensor at fault.

    >>> try:
    ...     remat.reshard("no-such-ckpt", "out", 2)
    ... except remat.ReshardError as err:
    ...     print("no-such-ckpt" in str(err))
    True
    """
