"""remat: train bigger models on the memory you have.

Plan, for every activation of a training step, whether to keep it, swap it to host memory
or recompute it, under a device budget in bytes (the planner is Rust, called in process);
run the plan in PyTorch (``remat.torch``); reshard checkpoints from N to M ranks.

    import remat
    g = remat.load_graph("step.json")          # or remat.torch.capture(...)
    p = remat.plan(g, "8GiB")                  # or 0.5 (of the store-all peak), or bytes
    print(p)                                   # the report `remat plan` prints
    remat.reshard("ckpt", "ckpt-w3", 3, format="dcp")
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
    """Bytes as remat prints them: ``1.50 MiB``."""
    return _native.human_bytes(n)
