"""Graphs and plans: the Python face of the Rust planner (``remat._native``).

Argument handling happens here (what a graph, a budget or a bandwidth may be given as);
parsing and planning are the library functions the ``remat plan`` command calls, so the same
budget text gives the same bytes and the same plan from both.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Union

from . import _arguments, _native
from .errors import ArgumentError, GraphError

__all__ = ["Graph", "Plan", "load_graph", "plan", "strategies"]

PathLike = Union[str, "os.PathLike[str]"]


class Graph:
    """A training step's graph: operations in execution order, each with a compute time
    (in units of ``time_unit_s`` seconds), output bytes and inputs, plus static bytes.

    >>> g = remat.load_graph("step.json")
    >>> g.num_nodes, g.store_all_peak > g.memory_floor
    (17, True)
    """

    __slots__ = ("_native",)

    def __init__(self, native: _native.Graph) -> None:
        if not isinstance(native, _native.Graph):
            raise TypeError(
                "remat.Graph is made by remat.load_graph(path) or remat.Graph.from_json(text)"
            )
        self._native = native

    @classmethod
    def load(cls, path: PathLike, *, time_unit_s: float = 1e-6) -> "Graph":
        """Reads remat JSON or networkx node-link JSON (Checkmate's graphs, whose unitless
        costs are read as ``time_unit_s`` seconds each)."""
        return cls(_native.Graph.load(os.fspath(path), time_unit_s))

    @classmethod
    def from_json(
        cls, text: str, *, file: str = "<string>", time_unit_s: float = 1e-6
    ) -> "Graph":
        """Parses JSON text; ``file`` names it in errors."""
        if not isinstance(text, str):
            raise TypeError(f"Graph.from_json takes a str, not {type(text).__name__}")
        return cls(_native.Graph.parse(text, file, time_unit_s))

    @property
    def name(self) -> str:
        return self._native.name

    @property
    def num_nodes(self) -> int:
        return self._native.num_nodes

    @property
    def store_all_peak(self) -> int:
        """Peak device bytes with every activation kept (static bytes included)."""
        return self._native.store_all_peak

    @property
    def memory_floor(self) -> int:
        """The least any schedule needs: static bytes plus the largest operation's inputs
        and output."""
        return self._native.memory_floor

    @property
    def recompute_floor(self) -> int:
        """The least peak recomputation alone can reach (no swaps), static bytes included:
        exact on small graphs, else a certified lower bound (see
        :attr:`recompute_floor_exact`). A budget under it needs swaps."""
        return self._native.recompute_floor[0]

    @property
    def recompute_floor_exact(self) -> bool:
        """Whether :attr:`recompute_floor` is the least peak itself, not a bound on it."""
        return self._native.recompute_floor[1]

    @property
    def static_bytes(self) -> int:
        return self._native.static_bytes

    @property
    def time_unit_s(self) -> float:
        return self._native.time_unit_s

    @property
    def base_time(self) -> float:
        """Every node's compute time once, in graph time units."""
        return self._native.base_time

    def nodes(self) -> list:
        """Every node as a dict: name, phase, compute_time, output_bytes, inputs, pinned."""
        return self._native.nodes()

    def to_json(self) -> str:
        """remat's graph JSON, as ``remat plan`` reads it."""
        return self._native.to_json()

    def save(self, path: PathLike) -> None:
        """Writes :meth:`to_json` to ``path`` atomically (temporary name, synced, renamed)."""
        self._native.save(os.fspath(path))

    def __len__(self) -> int:
        return self.num_nodes

    def __repr__(self) -> str:
        return (
            f"remat.Graph({self.name!r}: {self.num_nodes} nodes, store-all peak "
            f"{_native.human_bytes(self.store_all_peak)}, floor "
            f"{_native.human_bytes(self.memory_floor)}, recompute floor "
            f"{_native.human_bytes(self.recompute_floor)} "
            f"({'exact' if self.recompute_floor_exact else 'lower bound'}))"
        )


class Plan:
    """A plan with the simulator's report of it. Times are in the graph's time units
    (``time_unit_s`` seconds each); ``overhead`` is a ratio (``remat plan`` prints it in
    percent).

    >>> p = remat.plan("step.json", 0.5)
    >>> p.peak_bytes <= p.budget_bytes, p.overhead >= 0
    (True, True)
    """

    __slots__ = ("_native", "_decisions", "time_limit")

    def __init__(self, native: _native.Plan, time_limit: Optional[float] = None) -> None:
        self._native = native
        self._decisions: Optional[list] = None
        self.time_limit = time_limit

    graph = property(lambda self: Graph(self._native.graph))
    strategy = property(lambda self: self._native.strategy)
    budget_bytes = property(lambda self: self._native.budget_bytes)
    bandwidth = property(lambda self: self._native.bandwidth, doc="Bytes per second.")
    peak_bytes = property(lambda self: self._native.peak_bytes, doc="Simulated peak.")
    store_all_peak = property(lambda self: self._native.store_all_peak)
    total_time = property(lambda self: self._native.total_time)
    compute_time = property(
        lambda self: self._native.compute_time,
        doc="Every node's compute time once: the store-all time.",
    )
    recompute_time = property(lambda self: self._native.recompute_time)
    exposed_swap_time = property(
        lambda self: self._native.exposed_swap_time,
        doc="Time the compute stream waits on copies.",
    )
    overhead = property(
        lambda self: self._native.overhead,
        doc="(total - store-all time) / store-all time.",
    )
    time_unit_s = property(lambda self: self._native.time_unit_s)
    notes = property(
        lambda self: self._native.notes,
        doc="Strategies the search skipped or left out, as remat plan prints them.",
    )
    steps = property(
        lambda self: self._native.steps,
        doc='The schedule: ("compute"|"free"|"swap_out"|"swap_in", node index) pairs.',
    )
    timeline = property(
        lambda self: self._native.timeline,
        doc="(step, time, device bytes) after each step that changed the memory.",
    )

    @property
    def lower_bound(self) -> Optional[float]:
        """A lower bound on the overhead (a ratio, as ``overhead``) of every schedule at
        this budget, so ``overhead - lower_bound`` says how much better any plan could be;
        None when the planner gave none."""
        return self._native.lower_bound

    @property
    def lower_bound_source(self) -> Optional[tuple]:
        """(what proved the bound, which schedules it holds for), or None."""
        return self._native.lower_bound_source

    @property
    def reorders(self) -> bool:
        """Whether the plan runs the operations in another order than the graph's."""
        return self._native.reorders

    @property
    def kept_bytes(self) -> int:
        """Output bytes of the operations whose outputs are kept, each counted once over
        the step: not what is held at once (that is :attr:`peak_bytes`)."""
        return self._native.bytes_by_fate[0]

    @property
    def swapped_bytes(self) -> int:
        """Output bytes of the operations whose outputs are swapped out and back, each
        counted once over the step."""
        return self._native.bytes_by_fate[1]

    @property
    def recomputed_bytes(self) -> int:
        """Output bytes of the operations whose outputs are recomputed, each counted once
        over the step."""
        return self._native.bytes_by_fate[2]

    @property
    def decisions(self) -> list:
        """One dict per tensor, as the plan JSON: {"kind": "keep"}, {"kind": "swap", ...},
        {"kind": "recompute", ...}."""
        if self._decisions is None:
            self._decisions = json.loads(self._native.decisions_json())
        return [dict(d) for d in self._decisions]

    def to_json(self) -> str:
        """The plan file, as ``remat plan --out`` writes it."""
        return self._native.to_json()

    def save(self, path: PathLike, *, plot: Optional[PathLike] = None) -> None:
        """Writes the plan JSON to ``path`` (and, with ``plot``, its memory timeline as
        .svg or .png), all or nothing: temporary names, synced, renamed."""
        self._native.save(os.fspath(path), None if plot is None else os.fspath(plot))

    def plot(self, path: PathLike) -> None:
        """Draws the memory timeline against store-all's and the budget (.svg or .png)."""
        self._native.save(None, os.fspath(path))

    def summary(self) -> str:
        """The report lines ``remat plan`` prints."""
        return self._native.summary()

    def __str__(self) -> str:
        return self.summary().rstrip("\n")

    def __repr__(self) -> str:
        return (
            f"remat.Plan({self.strategy!r}: peak {_native.human_bytes(self.peak_bytes)}, "
            f"budget {_native.human_bytes(self.budget_bytes)}, "
            f"overhead {100.0 * self.overhead:.2f}%)"
        )


def strategies() -> list:
    """Registry names of every strategy, as ``remat plan --list`` lists them (the
    parameterized ``every:N``, ``by-depth:D``, ``threshold:F`` are accepted too).

    >>> "mutwo" in remat.strategies() and "store-all" in remat.strategies()
    True
    """
    return list(_native.strategies())


def load_graph(path: PathLike, *, time_unit_s: float = 1e-6) -> Graph:
    """Reads a graph file: remat JSON or networkx node-link JSON.

    >>> g = remat.load_graph("step.json")
    >>> remat.human_bytes(g.store_all_peak), remat.human_bytes(g.memory_floor)
    ('8.00 MiB', '3.00 MiB')
    """
    return Graph.load(path, time_unit_s=time_unit_s)


def plan(
    graph: Any,
    budget: Union[int, float, str],
    *,
    strategy: Optional[str] = None,
    bandwidth: Union[float, int, str] = 32e9,
    time_limit: Optional[float] = None,
    order: Optional[str] = None,
) -> Plan:
    """Plans keep / swap / recompute for ``graph`` under ``budget``.

    graph: a :class:`Graph`, a path, JSON text, a dict, or any object with ``to_json()``.
    budget: int bytes, a float fraction of the store-all peak (0 < f <= 1), or a string as
        ``remat plan --budget`` takes it ("8GiB", "1e9", "0.7").
    strategy: a name from :func:`strategies` (or ``every:N`` ...); None runs the anytime
        search (the fastest plan found within ``time_limit``), as ``remat plan`` without
        --strategy.
    bandwidth: host-device bytes per second, each direction (float, or "32GB/s").
    time_limit: seconds the search (or the ``anytime`` strategy) may take; default 1 s up
        to 1,000 nodes, 1 ms per node above. A named strategy that can stop early (``evict``,
        ``threshold``, ``checkmate-milp``, ...) stops there when it is given, else runs to its end.
    order: the plan form, as ``remat plan --order``: "free", "node" (the graph's order) or
        "eager" (what PyTorch's autograd runs as it is: the forward and backward in the
        graph's order, recomputation only right before a backward reader, offload right
        after a value is made); default: the graph's own marks.

    Raises ArgumentError for a value that cannot be read or used (the message is the one
    ``remat plan`` prints for the same value, after ``budget`` / ``bandwidth`` /
    ``time_limit`` instead of the flag: a zero or negative budget, a fraction above 1, a
    budget in bytes under 1 KiB where the graph's store-all peak is not itself that small,
    a bandwidth of 0); BudgetError for a budget no plan fits (below the memory floor, or
    every strategy's least peak above it); PlanError, GraphError.

    >>> p = remat.plan("step.json", 0.5)               # half the store-all peak
    >>> p.peak_bytes <= p.budget_bytes
    True
    >>> remat.plan("step.json", "6MiB", strategy="chen-greedy").strategy
    'chen-greedy'
    >>> remat.plan("step.json", 1)
    Traceback (most recent call last):
    ...
    remat.errors.ArgumentError: budget 1: 1 byte cannot hold a training step (a budget in bytes is at least 1 KiB); did you mean a fraction (1.0) or a size (1GiB)?
    """
    g = as_graph(graph)
    budget_bytes = _budget_bytes(budget, g)
    bytes_per_s = _bandwidth(bandwidth)
    limit = _time_limit(time_limit)
    if strategy is not None and not isinstance(strategy, str):
        raise ArgumentError(f"strategy: a name (str), not {type(strategy).__name__}")
    if order is not None and not isinstance(order, str):
        raise ArgumentError(f"order: a name (str), not {type(order).__name__}")
    native = _native.plan(g._native, budget_bytes, strategy, bytes_per_s, limit, order)
    return Plan(native, limit)


def as_graph(graph: Any) -> Graph:
    """A :class:`Graph` from what :func:`plan` accepts.

    >>> remat._plan.as_graph({"format": "remat-graph", "version": 1, "name": "one",
    ...     "nodes": [{"name": "a", "phase": "forward", "compute_time": 1,
    ...                "output_bytes": 8, "inputs": []}]}).name
    'one'
    """
    if isinstance(graph, Graph):
        return graph
    if isinstance(graph, _native.Graph):
        return Graph(graph)
    if isinstance(graph, dict):
        return Graph.from_json(json.dumps(graph), file="<dict>")
    if isinstance(graph, os.PathLike):
        return Graph.load(graph)
    if isinstance(graph, str):
        # JSON text starts with `{` (after blanks); anything else is a path.
        if graph.lstrip().startswith("{"):
            return Graph.from_json(graph)
        return Graph.load(graph)
    to_json = getattr(graph, "to_json", None)
    if callable(to_json):
        text = to_json()
        if not isinstance(text, str):
            raise GraphError(
                f"graph: {type(graph).__name__}.to_json() returned "
                f"{type(text).__name__}, not JSON text",
                file=None,
            )
        return Graph.from_json(text, file=f"<{type(graph).__name__}>")
    raise TypeError(
        "graph: give a remat.Graph, a path, JSON text, a dict or an object with "
        f"to_json(), not {type(graph).__name__}"
    )


def _budget_bytes(budget: Any, graph: Graph) -> int:
    """Bytes of ``budget``, through the same reader as ``remat plan --budget``."""
    return _native.parse_budget(_arguments.budget_text(budget, "budget"), graph._native,
                                "budget")


def _bandwidth(bandwidth: Any) -> float:
    return _arguments.bandwidth(bandwidth, "bandwidth")


def _time_limit(time_limit: Any) -> Optional[float]:
    if time_limit is None:
        return None
    return _arguments.seconds(time_limit, "time_limit")
