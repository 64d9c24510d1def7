"""``capture``: trace a training step, run it, measure it, and describe it as remat's graph."""

from __future__ import annotations

import json
import operator
import os
import statistics
import tempfile
import time
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from .._plan import as_graph
from ._graph import (
    IRNode,
    copy_positions,
    fx_inputs,
    is_random,
    op_name,
    tensor_leaves,
)
from ._trace import Traced, trace_step
from .errors import CaptureError

FORMAT = "remat-graph"
VERSION = 1
TIME_UNIT_S = 1e-6


class Captured:
    """One traced and profiled training step.

    ``nodes`` are remat's IR nodes (fx ``call_function`` nodes in order, then ``end:step``);
    ``to_json()`` / ``save(path)`` write remat's graph JSON, which ``remat.plan`` and
    ``remat plan`` read. Plans run in PyTorch through ``auto_checkpoint``.

    ```python
    import torch, torch.nn.functional as F
    import remat, remat.torch

    model = torch.nn.Sequential(*[torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        for _ in range(4)])
    x, y = torch.randn(512, 64), torch.randn(512, 64)
    captured = remat.torch.capture(model, (x, y), lambda m, x, y: F.mse_loss(m(x), y))
    captured.save("step.json")              # for `remat plan step.json --budget 0.5`
    print(remat.plan(captured, 0.8))
    ```
    """

    def __init__(self, model, traced: Traced, nodes: list[IRNode], static_bytes: int,
                 name: str, device: torch.device, timings: dict[str, float]):
        self.model = model
        self.traced = traced
        self.nodes = nodes
        self.static_bytes = static_bytes
        self.name = name
        self.device = device
        self.timings = timings
        self.index = {n.fx: i for i, n in enumerate(nodes) if n.fx is not None}
        self.loss_index = _loss_index(self)

    # ---- remat's graph ----------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def param_names(self) -> list[str]:
        return self.traced.param_names

    @property
    def has_random_ops(self) -> bool:
        """Whether the step draws random numbers (dropout): they come from one generator
        stream in node order, so a plan must compute them first in that order."""
        return any(n.is_random for n in self.nodes)

    def to_dict(self) -> dict:
        graph = {
            "format": FORMAT,
            "version": VERSION,
            "name": self.name,
            "time_unit_s": TIME_UNIT_S,
            "static_bytes": self.static_bytes,
        }
        if self.has_random_ops:
            # The planner then keeps the node order (it may otherwise reorder operations to
            # lower the peak), so replayed random ops draw what the unplanned step draws.
            graph["fixed_order"] = True
        return graph | {
            "nodes": [
                {
                    "name": n.name,
                    "phase": n.phase,
                    "compute_time": round(n.compute_us, 3),
                    "output_bytes": n.output_bytes,
                    "inputs": n.inputs,
                }
                for n in self.nodes
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the graph JSON atomically: a temporary file beside ``path``, synced, then
        renamed over it."""
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".remat-graph-", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.to_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def store_all_peak(self) -> int:
        """Peak bytes (static included) with every tensor kept from its computation to its
        last reader: remat's simulator's count (the Rust library, as ``remat plan``)."""
        return as_graph(self).store_all_peak

    def __repr__(self) -> str:
        return (
            f"Captured({self.name!r}, {len(self.nodes)} nodes, static {self.static_bytes} B, "
            f"store-all peak {self.store_all_peak()} B)"
        )

    # ---- feeding the graph --------------------------------------------------------------
    def static_values(self, inputs: Any, *, copy_buffers: bool = False) -> list[torch.Tensor]:
        """The placeholder values, in the graph's order: current parameters and buffers of
        the model, then the tensor leaves of ``inputs`` (checked against the example's)."""
        params = dict(self.model.named_parameters())
        buffers = dict(self.model.named_buffers())
        buffers.update(params)
        p = {k: params[k].detach() for k in self.traced.param_names}
        b = {}
        for k in self.traced.buffer_names:
            v = buffers[k].detach()
            b[k] = v.clone() if copy_buffers else v
        tensors = _input_tensors(self.traced, inputs)
        return pytree.tree_leaves((p, b, tensors))


def _input_tensors(traced: Traced, inputs: Any) -> list[torch.Tensor]:
    if isinstance(inputs, dict):
        args, kwargs = (), dict(inputs)
    elif isinstance(inputs, (tuple, list)):
        args, kwargs = tuple(inputs), {}
    else:
        args, kwargs = (inputs,), {}
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if spec != traced.input_spec:
        raise CaptureError(
            f"inputs have structure {spec}, the captured step was traced with "
            f"{traced.input_spec}"
        )
    tensors = [leaves[i] for i in traced.input_tensor_positions]
    return tensors


def _check_inputs(gm: torch.fx.GraphModule, values: list[torch.Tensor]) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(values):
        raise CaptureError(
            f"the step takes {len(placeholders)} tensors (parameters, buffers, inputs), "
            f"got {len(values)}"
        )
    for node, value in zip(placeholders, values):
        meta = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or meta is None:
            continue
        if tuple(value.shape) != tuple(meta.shape) or value.dtype != meta.dtype:
            raise CaptureError(
                f"input `{node.name}` has shape {tuple(value.shape)} dtype {value.dtype}; "
                f"the step was captured with shape {tuple(meta.shape)} dtype {meta.dtype}",
                node=node.name,
            )


def _loss_index(captured: Captured) -> int:
    """The op that computes the loss: the output itself, or the storage root of a view of
    it, or the multi-output op a getitem of it came from."""
    i = captured.index[captured.outputs_fx()[0]]
    while True:
        node = captured.nodes[i]
        if node.roots:
            i = min(node.roots)
        elif node.fx.target is operator.getitem and node.fx.args[0] in captured.index:
            i = captured.index[node.fx.args[0]]
        else:
            return i


def _outputs_fx(self) -> list[torch.fx.Node]:
    output = next(n for n in self.traced.gm.graph.nodes if n.op == "output")
    return [n for n in pytree.tree_leaves(output.args[0])]


Captured.outputs_fx = _outputs_fx


def capture(
    model: torch.nn.Module,
    example_inputs: Any,
    loss_fn: Callable | None = None,
    *,
    runs: int = 5,
    name: str | None = None,
) -> Captured:
    """Traces one training step of ``model`` and profiles it on the model's device.

    ``example_inputs``: a tuple of positional inputs (or one tensor), or a dict of keyword
    inputs. ``loss_fn(model, *inputs)`` (or ``loss_fn(model, **inputs)``) returns the scalar
    loss; without it the model's output is the loss, or its ``.loss`` (Hugging Face).
    ``runs``: timed runs per node (the median is kept), after one warm-up run.

    ```python
    import torch, torch.nn.functional as F
    import remat, remat.torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64))
    x, y = torch.randn(128, 64), torch.randn(128, 64)
    step = remat.torch.capture(model, (x, y), lambda m, x, y: F.mse_loss(m(x), y))
    print(step.name, len(step.nodes), "nodes")
    ```
    """
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(f"capture needs an nn.Module, got {type(model).__name__}")
    if runs < 1:
        raise CaptureError(f"runs must be at least 1, got {runs}")
    start = time.perf_counter()
    traced = trace_step(model, example_inputs, loss_fn)
    traced_at = time.perf_counter()
    device = _device_of(model)
    nodes, static_bytes = _profile(traced, model, example_inputs, runs, device)
    done = time.perf_counter()
    timings = {"trace_s": traced_at - start, "profile_s": done - traced_at,
               "capture_s": done - start}
    captured = Captured(model, traced, nodes, static_bytes,
                        name or type(model).__name__, device, timings)
    for i, n in enumerate(captured.nodes):
        n.phase = "backward" if i >= captured.loss_index else "forward"
    return captured


def _device_of(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _profile(traced: Traced, model, example_inputs, runs: int, device):
    """Runs the joint graph ``runs + 1`` times, node by node: the first run measures which
    storages each node makes or aliases, the others time each node (median kept)."""
    gm = traced.gm
    graph_nodes = list(gm.graph.nodes)
    calls = [n for n in graph_nodes if n.op == "call_function"]
    nodes = [
        IRNode(name=n.name, fx=n, is_random=is_random(n), copy_on_recompute=copy_positions(n))
        for n in calls
    ]
    index = {n: i for i, n in enumerate(calls)}
    samples: list[list[float]] = [[] for _ in calls]
    shim = Captured.__new__(Captured)
    shim.model, shim.traced = model, traced
    values = shim.static_values(example_inputs, copy_buffers=True)
    _check_inputs(gm, values)
    devices = [device.index or 0] if device.type == "cuda" else []
    static_bytes = 0
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        for run in range(runs + 1):
            env = _static_env(gm, graph_nodes, values)
            if run == 0:
                owner, static_bytes = _static_owners(env)
            for n in calls:
                args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
                _sync(device)
                t0 = time.perf_counter()
                try:
                    out = n.target(*args, **kwargs)
                except Exception as error:  # noqa: BLE001 - named and re-raised
                    raise CaptureError(
                        f"node `{n.name}` ({op_name(n)}) failed on the model's device "
                        f"{device}: {type(error).__name__}: {error}", node=n.name
                    ) from error
                _sync(device)
                samples[index[n]].append(time.perf_counter() - t0)
                env[n] = out
                if run == 0:
                    _measure(nodes, index, n, out, owner, env)
            del env
    for i, node in enumerate(nodes):
        timed = samples[i][1:] if runs >= 1 else samples[i]
        node.compute_us = statistics.median(timed) * 1e6
    _link(nodes, index)
    _add_end(nodes, index, gm)
    return nodes, static_bytes


def _static_env(gm, graph_nodes, values) -> dict:
    env = {}
    it = iter(values)
    for n in graph_nodes:
        if n.op == "placeholder":
            env[n] = next(it)
        elif n.op == "get_attr":
            env[n] = _get_attr(gm, n.target)
    return env


def _get_attr(gm, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _static_owners(env: dict) -> tuple[dict[int, int], int]:
    """Storages of the static values (owner -1) and their total bytes."""
    owner: dict[int, int] = {}
    total = 0
    for value in env.values():
        for t in tensor_leaves(value):
            s = t.untyped_storage()
            if s.nbytes() and s.data_ptr() not in owner:
                owner[s.data_ptr()] = -1
                total += s.nbytes()
    return owner, total


def _measure(nodes, index, fx_node, out, owner: dict[int, int], env) -> None:
    """Bytes and roots of one node's output, from the storages it holds."""
    i = index[fx_node]
    node = nodes[i]
    parent = None
    if fx_node.target is operator.getitem and fx_node.args[0] in index:
        parent = index[fx_node.args[0]]
    roots: set[int] = set()
    leaves = tensor_leaves(out)
    owned = 0
    for t in leaves:
        s = t.untyped_storage()
        ptr, nbytes = s.data_ptr(), s.nbytes()
        if nbytes == 0:
            continue
        o = owner.get(ptr)
        if o is None or (parent is not None and o == parent):
            # A new storage, or one the multi-output parent made: this node's own tensor.
            owner[ptr] = i
            owned += nbytes
        elif o >= 0 and o != i:
            roots.add(o)
    node.output_bytes = owned
    node.roots = sorted(roots)
    # A pure view is rebuilt for free when read after its root was released; an op that
    # writes into its input (``copy_`` into a buffer) must never run again that way.
    node.is_view = bool(leaves) and owned == 0 and not node.copy_on_recompute


def _link(nodes: list[IRNode], index) -> None:
    """IR inputs: every node read, plus the roots of the views read."""
    for node in nodes:
        inputs: set[int] = set()
        for m in fx_inputs(node.fx):
            j = index.get(m)
            if j is None:
                continue
            inputs.add(j)
            inputs.update(nodes[j].roots)
        node.inputs = sorted(inputs)


def _add_end(nodes: list[IRNode], index, gm) -> None:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    inputs: set[int] = set()
    for m in pytree.tree_leaves(output.args[0]):
        j = index.get(m) if isinstance(m, torch.fx.Node) else None
        if j is not None:
            inputs.add(j)
            inputs.update(nodes[j].roots)
    nodes.append(IRNode(name="end:step", fx=None, phase="backward", inputs=sorted(inputs)))
