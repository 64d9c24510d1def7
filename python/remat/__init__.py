"""remat: train bigger models on the memory you have.

Plan, for every activation of a training step, whether to keep it, swap it to host memory
or recompute it, under a device budget in bytes (the planner is Rust, called in process);
run the plan in PyTorch (``remat.torch``); reshard checkpoints from N to M ranks.

    import remat
    g = remat.load_graph("step.json")          # or remat.torch.capture(...)
    p = remat.plan(g, "8GiB")                  # or 0.5 (of the store-all peak), or bytes
    print(p)                                   # the report `remat plan` prints
    remat.reshard("ckpt", "ckpt-w3", 3, format="dcp")

A graph can be given as JSON text too; the smallest step, one operation reading the input:

>>> import json, remat
>>> step = {"format": "remat-graph", "version": 1, "name": "tiny", "static_bytes": 0,
...         "nodes": [
...     {"name": "x", "phase": "forward", "compute_time": 1.0, "output_bytes": 1024, "inputs": []},
...     {"name": "y", "phase": "forward", "compute_time": 1.0, "output_bytes": 1024, "inputs": [0]}]}
>>> p = remat.plan(json.dumps(step), "2KiB", strategy="store-all")
>>> remat.human_bytes(p.peak_bytes)
'2.00 KiB'

Errors are ``remat.RematError`` subclasses that name what is wrong:

>>> remat.plan(json.dumps(step), "1KiB")
Traceback (most recent call last):
    ...
remat.errors.BudgetError: ...
"""

from __future__ import annotations

from . import _native
from ._plan import Graph, Plan, load_graph, plan, strategies
from ._reshard import reshard, verify
from .errors import (
    ArgumentError,
    BudgetError,
    GraphError,
    OutputError,
    PlanError,
    RematError,
    ReshardError,
)

__all__ = [
    "Graph",
    "Plan",
    "load_graph",
    "plan",
    "strategies",
    "reshard",
    "verify",
    "human_bytes",
    "RematError",
    "ArgumentError",
    "GraphError",
    "BudgetError",
    "PlanError",
    "OutputError",
    "ReshardError",
]


def human_bytes(n: int) -> str:
    """Bytes as remat prints them everywhere (the command line, plans, errors): binary
    units with two decimals.

    >>> human_bytes(1536 * 1024)
    '1.50 MiB'
    >>> human_bytes(3 * 2**30)
    '3.00 GiB'
    """
    return _native.human_bytes(n)
