"""``apply``: run a captured training step under a remat plan.

The interpreter walks the plan's steps over the fx graph: ``compute`` runs a node on its
resident inputs (a first computation or a recompute), ``free`` drops the interpreter's
reference, ``swap_out`` copies a value to the host store, ``swap_in`` starts the copy back.
It counts what it holds: the bytes of the distinct tensor storages referenced by resident
values (static ones excluded), after every step that adds one, so the measured peak is
comparable with remat's simulated one (``static_bytes`` + resident tensors).

Views own no storage in remat's graph: when their root is freed or swapped out, the
interpreter drops them as well, and rebuilds a view from its (resident) root when a node
reads it, so a view never keeps a storage alive that the plan has released.

Random ops (dropout's ``bernoulli``): the generator state before a node's first run is
recorded and restored around each recompute, so a replay draws the same numbers and
leaves the generator where the keep-everything step leaves it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Iterable

import torch

from ._graph import tensor_leaves
from .capture import Captured, _check_inputs, _static_env
from .errors import ScheduleError
from .store import FileStore, PinnedStore, default_store

_ABSENT = object()
_OPS = ("compute", "free", "swap_out", "swap_in")


@dataclasses.dataclass
class StepStats:
    """Measurements of the last run."""

    peak_bytes: int = 0  # activations: distinct storages held by the interpreter, at most
    static_bytes: int = 0  # parameters, buffers, inputs (as in the graph)
    computes: int = 0
    recomputes: int = 0
    swaps_out: int = 0
    swaps_in: int = 0
    seconds: float = 0.0

    @property
    def peak_total_bytes(self) -> int:
        """Comparable with remat's simulated peak."""
        return self.static_bytes + self.peak_bytes


class _Ledger:
    """Counts the bytes of distinct storages the interpreter references."""

    def __init__(self, static_ptrs: set[int]):
        self.static = static_ptrs
        self.refs: dict[int, list[int]] = {}
        self.reserved: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def hold(self, value) -> None:
        for t in tensor_leaves(value):
            s = t.untyped_storage()
            ptr, nbytes = s.data_ptr(), s.nbytes()
            if nbytes == 0 or ptr in self.static:
                continue
            entry = self.refs.get(ptr)
            if entry is None:
                self.refs[ptr] = [1, nbytes]
                self.live += nbytes
            else:
                entry[0] += 1
        self.peak = max(self.peak, self.live)

    def release(self, value) -> None:
        for t in tensor_leaves(value):
            s = t.untyped_storage()
            entry = self.refs.get(s.data_ptr())
            if entry is None:
                continue
            entry[0] -= 1
            if entry[0] == 0:
                self.live -= entry[1]
                del self.refs[s.data_ptr()]

    def reserve(self, key: int, nbytes: int) -> None:
        """Bytes of a swap-in in flight: counted from its issue, as the simulator does."""
        self.reserved[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def unreserve(self, key: int) -> None:
        self.live -= self.reserved.pop(key, 0)


def plan_steps(plan: Any) -> list[tuple[str, int]]:
    """The steps of a ``remat.Plan``, a plan dict, or plan JSON text, as (op, node)."""
    if hasattr(plan, "steps") and not isinstance(plan, dict):
        raw = plan.steps
    else:
        if isinstance(plan, (str, bytes)):
            plan = json.loads(plan)
        raw = plan["steps"]
    steps = []
    for k, step in enumerate(raw):
        if isinstance(step, dict):
            op = step.get("op")
            node = step.get("node", step.get("tensor"))
        else:
            op, node = step
        if op not in _OPS or not isinstance(node, int):
            raise ScheduleError(f"plan step {k} is {step!r}, not one of {_OPS} with a node")
        steps.append((op, node))
    return steps


def keep_everything_steps(captured: Captured) -> list[tuple[str, int]]:
    """The store-all schedule: every node once, in order, each tensor freed after its last
    reader (what the graph's store-all peak assumes)."""
    last = list(range(captured.num_nodes))
    for i, n in enumerate(captured.nodes):
        for j in n.inputs:
            last[j] = max(last[j], i)
    frees: list[list[int]] = [[] for _ in captured.nodes]
    for j, i in enumerate(last):
        frees[i].append(j)
    steps = []
    for i in range(captured.num_nodes):
        steps.append(("compute", i))
        steps.extend(("free", j) for j in frees[i])
    return steps


def simulated_peak(captured: Captured, steps: Iterable[tuple[str, int]]) -> int:
    """Peak bytes of a schedule in remat's memory model (static + device tensors)."""
    on = [False] * captured.num_nodes
    live = peak = captured.static_bytes
    for op, i in steps:
        if op in ("compute", "swap_in") and not on[i]:
            on[i] = True
            live += captured.nodes[i].output_bytes
            peak = max(peak, live)
        elif op == "free" and on[i]:
            on[i] = False
            live -= captured.nodes[i].output_bytes
    return peak


class Step:
    """A training step under a plan: ``loss, grads = step(*inputs)`` (or ``**inputs`` when
    the step was captured with keyword inputs). ``grads`` maps parameter names to
    gradients; ``step.set_grads(grads)`` writes them to the model's ``.grad``."""

    def __init__(self, captured: Captured, plan: Any = None, *, store=None):
        self.captured = captured
        plan = _load_plan(plan)
        self.steps = keep_everything_steps(captured) if plan is None else plan_steps(plan)
        self._check_plan(plan)
        self._needs_store = any(op == "swap_out" for op, _ in self.steps)
        self.store = store
        if self.store is None and self._needs_store:
            self.store = default_store(captured.device)
        self.stats = StepStats(static_bytes=captured.static_bytes)
        # Called with every value the interpreter starts holding (computed, rebuilt view,
        # swapped in), e.g. by a benchmark that counts storages the same way for all.
        self.observer = None
        self._views_of: list[list[int]] = [[] for _ in captured.nodes]
        for i, n in enumerate(captured.nodes):
            if n.is_view:
                for r in n.roots:
                    self._views_of[r].append(i)
        self._outputs = captured.outputs_fx()

    # ---- checks -------------------------------------------------------------------------
    def _check_plan(self, plan) -> None:
        n = self.captured.num_nodes
        count = getattr(plan, "node_count", None)
        if count is None and isinstance(plan, dict):
            count = plan.get("node_count")
        if count is not None and count != n:
            raise ScheduleError(
                f"the plan is for a graph of {count} nodes, the captured step has {n}"
            )
        random_first: list[int] = []
        seen = set()
        for k, (op, i) in enumerate(self.steps):
            if not 0 <= i < n:
                raise ScheduleError(f"plan step {k} ({op}) names node {i}; the graph has {n}")
            if op == "compute" and i not in seen:
                seen.add(i)
                if self.captured.nodes[i].is_random:
                    random_first.append(i)
            if op == "swap_out":
                node = self.captured.nodes[i]
                if node.roots and node.output_bytes:
                    raise ScheduleError(
                        f"plan step {k} swaps `{node.name}`, whose value both owns storage "
                        "and aliases another node's; such values cannot be swapped"
                    )
        if random_first != sorted(random_first):
            raise ScheduleError(
                "the plan runs random nodes for the first time out of graph order "
                f"({[self.captured.nodes[i].name for i in random_first]}); their "
                "random numbers would differ from the step without a plan"
            )
        if len(seen) != n:
            missing = next(i for i in range(n) if i not in seen)
            raise ScheduleError(
                f"the plan never computes node {missing} `{self.captured.nodes[missing].name}`"
            )

    # ---- running ------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if kwargs:
            return self.run(kwargs)
        if self.captured.traced.keyword_inputs and len(args) == 1:
            return self.run(args[0])
        return self.run(args)

    def run(self, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        captured = self.captured
        values = captured.static_values(inputs)
        gm = captured.traced.gm
        _check_inputs(gm, values)
        run = _Run(self, _static_env(gm, list(gm.graph.nodes), values))
        start = time.perf_counter()
        try:
            with torch.no_grad():
                loss, grads = run.execute()
        finally:
            if self.store is not None:
                self.store.clear()
        self.stats = StepStats(
            peak_bytes=run.ledger.peak,
            static_bytes=captured.static_bytes,
            computes=run.computes,
            recomputes=run.recomputes,
            swaps_out=run.swaps_out,
            swaps_in=run.swaps_in,
            seconds=time.perf_counter() - start,
        )
        return loss, dict(zip(captured.param_names, grads))

    def set_grads(self, grads: dict[str, torch.Tensor]) -> None:
        set_grads(self.captured.model, grads)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def set_grads(model: torch.nn.Module, grads: dict[str, torch.Tensor]) -> None:
    """Writes gradients (by parameter name) into ``.grad``, accumulating like
    ``loss.backward()`` does when a gradient is already there."""
    params = dict(model.named_parameters())
    for name, g in grads.items():
        p = params.get(name)
        if p is None:
            raise KeyError(f"the model has no parameter `{name}`")
        g = g.detach()
        if p.grad is None:
            p.grad = g.clone() if g._base is not None or not g.is_contiguous() else g
        else:
            p.grad.add_(g)


class _Run:
    """The state of one execution of a schedule."""

    def __init__(self, step: Step, static_env: dict):
        self.step = step
        self.captured = step.captured
        self.nodes = step.captured.nodes
        self.index = step.captured.index
        self.static_env = static_env
        static_ptrs = {
            t.untyped_storage().data_ptr()
            for v in static_env.values()
            for t in tensor_leaves(v)
        }
        self.ledger = _Ledger(static_ptrs)
        if step.observer is not None:
            hold, observer = self.ledger.hold, step.observer

            def observed(value):
                hold(value)
                observer(value)

            self.ledger.hold = observed
        self.values: list[Any] = [_ABSENT] * len(self.nodes)
        self.times_computed = [0] * len(self.nodes)
        self.rng_states: dict[int, torch.Tensor] = {}
        self.pending_in: dict[int, Any] = {}
        self.swapped_out: set[int] = set()
        self.result = None
        self.computes = self.recomputes = self.swaps_out = self.swaps_in = 0
        self.k = 0
        device = self.captured.device
        self._cuda = device.type == "cuda"
        self._device = device

    def execute(self):
        for self.k, (op, i) in enumerate(self.step.steps):
            if op == "compute":
                self._compute(i)
            elif op == "free":
                self._free(i)
            elif op == "swap_out":
                self._swap_out(i)
            else:
                self._swap_in(i)
        if self.result is None:
            raise ScheduleError("the plan ended without computing end:step")
        for i in range(len(self.values)):
            if self.values[i] is not _ABSENT or i in self.pending_in:
                self._free(i)
        return self.result

    # ---- steps ----------------------------------------------------------------------------
    def _compute(self, i: int) -> None:
        node = self.nodes[i]
        if self.values[i] is not _ABSENT:
            if not node.is_view:
                raise ScheduleError(
                    f"plan step {self.k} computes `{node.name}`, which is already on the device"
                )
            self._drop(i)
        if node.fx is None:  # end:step
            outs = [self._lookup(m) for m in self.step._outputs]
            self.result = (outs[0], outs[1:])
            self.times_computed[i] += 1
            return
        recompute = self.times_computed[i] > 0
        args, kwargs = torch.fx.node.map_arg((node.fx.args, node.fx.kwargs), self._lookup)
        if recompute and node.copy_on_recompute:
            args = tuple(
                a.clone() if p in node.copy_on_recompute and isinstance(a, torch.Tensor) else a
                for p, a in enumerate(args)
            )
        if node.is_random:
            out = self._run_random(i, node, args, kwargs, recompute)
        else:
            out = node.fx.target(*args, **kwargs)
        self.values[i] = out
        self.ledger.hold(out)
        self.times_computed[i] += 1
        self.computes += 1
        self.recomputes += recompute

    def _run_random(self, i, node, args, kwargs, recompute: bool):
        generator = _explicit_generator(args, kwargs)
        if not recompute:
            self.rng_states[i] = self._get_rng(generator)
            return node.fx.target(*args, **kwargs)
        now = self._get_rng(generator)
        self._set_rng(generator, self.rng_states[i])
        try:
            return node.fx.target(*args, **kwargs)
        finally:
            self._set_rng(generator, now)

    def _get_rng(self, generator) -> torch.Tensor:
        if generator is not None:
            return generator.get_state()
        if self._cuda:
            return torch.cuda.get_rng_state(self._device)
        return torch.get_rng_state()

    def _set_rng(self, generator, state: torch.Tensor) -> None:
        if generator is not None:
            generator.set_state(state)
        elif self._cuda:
            torch.cuda.set_rng_state(state, self._device)
        else:
            torch.set_rng_state(state)

    def _free(self, i: int) -> None:
        if i in self.pending_in:  # swapped in, never read
            self._resolve(i)
        if i in self.swapped_out:
            self.step.store.wait_put(i)
            self.swapped_out.discard(i)
        self._drop(i)
        for v in self.step._views_of[i]:
            self._drop(v)

    def _drop(self, i: int) -> None:
        value = self.values[i]
        if value is not _ABSENT:
            self.ledger.release(value)
            self.values[i] = _ABSENT

    def _swap_out(self, i: int) -> None:
        node = self.nodes[i]
        if node.is_view or node.output_bytes == 0:
            return  # nothing of its own to copy: rebuilt from its roots when read
        value = self.values[i]
        if value is _ABSENT:
            raise ScheduleError(
                f"plan step {self.k} swaps out `{node.name}`, which is not on the device"
            )
        self.step.store.put(i, value)
        self.swapped_out.add(i)
        self.swaps_out += 1

    def _swap_in(self, i: int) -> None:
        node = self.nodes[i]
        if node.is_view or node.output_bytes == 0:
            return
        self.ledger.reserve(i, node.output_bytes)
        self.pending_in[i] = self.step.store.get(i)
        self.swaps_in += 1

    def _resolve(self, i: int) -> None:
        value = self.step.store.take(self.pending_in.pop(i))
        self.ledger.unreserve(i)
        self.values[i] = value
        self.ledger.hold(value)

    # ---- reading ----------------------------------------------------------------------------
    def _lookup(self, fx_node: torch.fx.Node):
        value = self.static_env.get(fx_node, _ABSENT)
        if value is not _ABSENT:
            return value
        j = self.index[fx_node]
        value = self.values[j]
        if value is not _ABSENT:
            return value
        if j in self.pending_in:
            self._resolve(j)
            return self.values[j]
        node = self.nodes[j]
        if node.is_view:
            args, kwargs = torch.fx.node.map_arg((node.fx.args, node.fx.kwargs), self._lookup)
            value = node.fx.target(*args, **kwargs)
            self.values[j] = value
            self.ledger.hold(value)
            return value
        raise ScheduleError(
            f"plan step {self.k}: `{fx_node.name}` is read but not on the device "
            "(freed or swapped out without a swap_in)"
        )


def _load_plan(plan: Any) -> Any:
    """A plan as given, or parsed when it is JSON text or a file's path."""
    if isinstance(plan, bytes):
        return json.loads(plan)
    if isinstance(plan, str) and plan.lstrip().startswith("{"):
        return json.loads(plan)
    if isinstance(plan, (str, os.PathLike)):
        with open(plan) as f:
            return json.load(f)
    return plan


def _explicit_generator(args, kwargs) -> torch.Generator | None:
    """A generator passed to a random op, which it draws from instead of the default."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Generator):
            return value
    return None


def apply(captured: Captured, plan: Any = None, *, store=None) -> Step:
    """The training step of ``captured`` under ``plan`` (a ``remat.Plan``, a plan dict,
    plan JSON text or a plan file's path; ``None``: keep everything). ``store``: where swapped tensors go (default: a
    ``FileStore`` on CPU, a ``PinnedStore`` on CUDA)."""
    return Step(captured, plan, store=store)


__all__ = ["apply", "Step", "StepStats", "set_grads", "FileStore", "PinnedStore",
           "plan_steps", "keep_everything_steps", "simulated_peak"]
