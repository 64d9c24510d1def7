"""``auto_checkpoint``: remat inside PyTorch's own autograd, for an unmodified model.

```python
model = remat.torch.auto_checkpoint(model, memory_budget="8GiB")   # or 0.5
for batch in loader:                   # the loop does not change
    loss = model(**batch).loss
    loss.backward(); opt.step(); opt.zero_grad()
```

The first training step with a given input signature runs as plain eager while it is
profiled (every aten op, saved tensor and storage; see ``_eager_profile``); the planner then
chooses, for every tensor autograd saves, keep / offload / recompute under the budget, and
every later step with that signature runs the model's own forward under saved-tensor hooks
that do it (``_eager_run``). Loss, gradients, buffers and the random state are bit-identical
to plain eager. Outside training (``model.eval()``, ``torch.no_grad()``) nothing is hooked.

The budget: bytes mean the step's peak (static tensors, activations and gradients; on CUDA as
``torch.cuda.max_memory_allocated`` reports it); a float in (0, 1] is a fraction of the
step's *activation* bytes (the unplanned peak above the static bytes). Everything the
forward returns (logits, a key/value cache, hidden states) is counted as held by the caller
through the whole backward, the worst a caller can do, so the step stays within its
prediction whether ``out`` is kept or dropped (``_eager_profile``'s note 6); modules whose
re-run would change what the caller holds (a cache they append to) are never run under
``torch.utils.checkpoint`` (note 7). On a CPU device the
host is the device's own memory, so plans there recompute only. On CUDA the profiled step
resets the allocator's peak counter around each op to read the op's workspace (memory it
holds beyond its outputs while it runs), which the predicted peak counts: read
``torch.cuda.max_memory_allocated`` from the steps after the profiled one.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.utils.checkpoint
from torch.utils import _pytree as pytree

from .. import _arguments, _native
from ._eager_graph import quantized
from ._eager_plan import KEEP, OFFLOAD, RECOMPUTE, EagerPlan, StepGraph, plan_step
from ._eager_profile import Profile, Profiler, release_outside_modes
from ._eager_run import RunMode, RuntimePlan, StepState, make_hooks
from . import _plan_file, _plan_ranks
from ._store import FileStore, check_store, measure_store_bandwidth
from .capture import _device_of
from .errors import CaptureError, PlanMismatchError

_ATTR = "_remat_auto"
_log = logging.getLogger("remat")


class _Entry:
    """One input signature: its profile (once complete) and plan."""

    def __init__(self, signature: str = ""):
        self.signature = signature  # the input signature as text (``_plan_file``)
        self.profile: Optional[Profile] = None
        self.static_bytes = 0
        self.plan: Optional[EagerPlan] = None
        self.runtime: Optional[RuntimePlan] = None
        self.pending: Optional[Profiler] = None
        self.stale = False
        self.steps = 0
        self.plan_seconds = 0.0
        self.bandwidth: Optional[float] = None  # the link the plan was made for


class AutoCheckpoint:
    """The controller ``auto_checkpoint`` attaches to a model (``remat.torch.controller``).

    ```python
    import torch, torch.nn.functional as F
    import remat.torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        for _ in range(4)])
    x, y = torch.randn(128, 64), torch.randn(128, 64)
    remat.torch.auto_checkpoint(model, "2MiB")
    for _ in range(2):
        F.mse_loss(model(x), y).backward()
    ctl = remat.torch.controller(model)     # this class
    plan = ctl.plan
    print(plan.predicted_peak <= plan.budget_bytes, ctl.table())
    ```
    """

    def __init__(self, model: torch.nn.Module, memory_budget, *, offload: Optional[bool],
                 bandwidth: Optional[float], time_limit: Optional[float],
                 max_plans: int, strategy: Optional[str], store: Optional[Path] = None,
                 share_plan: bool = True, plans: Optional[dict[str, dict]] = None,
                 plan_source: str = ""):
        self.model = model
        self.store = FileStore(store) if store is not None else None
        self.memory_budget = memory_budget
        self.offload = offload
        self.bandwidth = bandwidth
        self.time_limit = time_limit
        self.strategy = strategy
        self.max_plans = max_plans
        self.entries: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()
        self.forward = model.forward
        self.enabled = True
        self.reprofiles = 0
        self._warned_compile = False
        # Plans loaded from a file (``plan=``), by input signature; None: plan each step.
        self.loaded = plans
        self.plan_source = plan_source
        self.share_plan = share_plan
        self.evictions = 0  # input signatures whose plans ``max_plans`` dropped
        self._warned_eviction = False

    # ---- the forward --------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        release_outside_modes(force=True)  # a profiled step's outside mode ends here at last
        if not self._active():
            return self.forward(*args, **kwargs)
        key = _signature(self.model, args, kwargs)
        entry = self.entries.get(key)
        if entry is None or entry.stale or (entry.runtime is not None
                                            and entry.runtime.refused):
            if entry is not None:
                self.reprofiles += 1
            entry = _Entry(_plan_file.signature_text(key))
            self._check_loaded(entry.signature)
            self.entries[key] = entry
            self._evict()
        self.entries.move_to_end(key)
        if entry.plan is None and entry.profile is not None:
            self._plan(entry)
        if entry.plan is None:
            return self._profile(entry, args, kwargs)
        entry.steps += 1
        if entry.plan.keeps_everything:
            return self.forward(*args, **kwargs)
        if entry.plan.checkpoint_modules:
            return self._run_checkpointed(entry.plan.checkpoint_modules, args, kwargs)
        return self._run(entry, args, kwargs)

    def _evict(self) -> None:
        """Drops the least recently used signatures beyond ``max_plans``: counted in
        ``evictions``, logged each time (logger ``remat``), warned about once."""
        while len(self.entries) > self.max_plans:
            _, dropped = self.entries.popitem(last=False)
            self.evictions += 1
            message = (f"remat: max_plans={self.max_plans} input signatures are cached; the "
                       f"plan of the least recently used one, {dropped.signature}, is dropped "
                       "and that shape is profiled and planned again when it comes back")
            _log.info(message)
            if not self._warned_eviction:
                self._warned_eviction = True
                warnings.warn(message + " (raise max_plans to keep more; this warning is "
                              "given once, controller(model).evictions counts them)",
                              stacklevel=4)

    def _check_loaded(self, signature: str) -> None:
        if self.loaded is None or signature in self.loaded:
            return
        known = "; ".join(sorted(self.loaded))
        raise PlanMismatchError(
            f"plan {self.plan_source} has no plan for input signature {signature} (it has: "
            f"{known}); save the plan after steps with every input shape, or call "
            "auto_checkpoint without plan= to plan this one", source=self.plan_source,
            field="signature")

    def _active(self) -> bool:
        if not (self.enabled and self.model.training and torch.is_grad_enabled()):
            return False
        if torch.compiler.is_compiling():
            if not self._warned_compile:
                warnings.warn("remat.torch.auto_checkpoint does not plan inside "
                              "torch.compile: the compiled model runs as compiled, without "
                              "remat's plan (use torch.compile's activation_memory_budget "
                              "there)", stacklevel=3)
                self._warned_compile = True
            return False
        return True

    def _profile(self, entry: _Entry, args, kwargs):
        device = _device_of(self.model)
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else _nothing
        profiler = Profiler(self.model, device, sync)
        entry.pending = profiler
        baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else None

        def complete(profile: Profile) -> None:
            if entry.pending is profiler:
                entry.profile = profile
                entry.static_bytes = baseline if baseline is not None else profile.static_bytes
                entry.pending = None

        profiler.on_complete = complete
        profiler.begin_forward()
        try:
            with torch.autograd.graph.saved_tensors_hooks(profiler.pack, profiler.unpack):
                out = self.forward(*args, **kwargs)
        except BaseException:
            profiler.__exit__(None, None, None)
            raise
        finally:
            for h in profiler._module_hooks:
                h.remove()
        profiler.end_forward(out)
        return out

    def _plan(self, entry: _Entry) -> None:
        device = entry.profile.device
        if device.type == "cuda":
            # The device's count when the planned step starts, not when the profiled one
            # did: an optimizer's state appears at its first step, after the profile.
            entry.static_bytes = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        if self.loaded is not None:
            record = self.loaded[entry.signature]
            entry.plan = _plan_file.bind(entry.profile, entry.static_bytes, record,
                                         source=f"plan {self.plan_source}")
            entry.bandwidth = record["bandwidth"]
        elif _plan_ranks.sharing(self.share_plan):
            ops = _plan_file.structure(entry.profile)
            _plan_ranks.check_same_step(entry.signature, ops)
            planned: list[EagerPlan] = []

            def make_record() -> dict:
                planned.append(self._plan_here(entry))
                return self._record(entry, planned[0], ops)

            record, here = _plan_ranks.share(make_record)
            if here:
                entry.plan = planned[0]
            else:
                entry.plan = _plan_file.bind(entry.profile, entry.static_bytes, record,
                                             source="rank 0's plan")
                entry.bandwidth = record["bandwidth"]
        else:
            entry.plan = self._plan_here(entry)
        entry.plan_seconds = time.perf_counter() - start
        self._check_runnable(entry.plan, device)
        entry.runtime = RuntimePlan(entry.profile, entry.plan, device, self.store)

    def _plan_here(self, entry: _Entry) -> EagerPlan:
        entry.bandwidth = self._bandwidth(entry.profile.device)
        return plan_step(entry.profile, entry.static_bytes, self.memory_budget,
                         bandwidth=entry.bandwidth,
                         time_limit=self.time_limit, strategy=self.strategy)

    def _record(self, entry: _Entry, plan: EagerPlan, ops=None) -> dict:
        return _plan_file.record_of(
            plan, ops if ops is not None else _plan_file.structure(entry.profile),
            entry.signature, self.memory_budget, entry.bandwidth,
            _plan_file.frames_of(entry.profile, plan))


    def _check_runnable(self, plan: EagerPlan, device: torch.device) -> None:
        if device.type != "cuda" and self.store is None and any(
                d == OFFLOAD for d in plan.decisions.values()):
            raise PlanMismatchError(
                f"{self.plan_source or 'the shared plan'} offloads saved tensors, which a "
                "CPU model does only to a store: give auto_checkpoint store=DIRECTORY",
                source=self.plan_source or None, field="store")

    def save(self, path) -> None:
        """Writes the plan of every input signature planned so far to ``path`` (JSON,
        versioned; a temporary name, synced, renamed), for
        ``auto_checkpoint(model, memory_budget, plan=path)``: the same decisions, with no
        planning, on a model with the same parameters, buffers and module tree, for the
        same input signatures and budget."""
        records = [self._record(e, e.plan) for e in self.entries.values()
                   if e.plan is not None]
        if not records:
            raise CaptureError("no plan yet to save: run two training steps first (the "
                               "first profiles, the second plans)")
        _plan_file.write(Path(path), self.model, records)

    def _bandwidth(self, device: torch.device) -> Optional[float]:
        if self.offload is False:
            return None
        if device.type != "cuda":
            # The host is this device's own memory: recompute only, unless the caller named
            # a store to offload to (a directory; its files' bytes leave the process).
            if self.store is None:
                return None
            if self.bandwidth is not None:
                return float(self.bandwidth)
            return _quantized_rate(measure_store_bandwidth(self.store.directory))
        if self.bandwidth is not None:
            return float(self.bandwidth)
        return _quantized_rate(_measure_copy_bandwidth(device))

    def _run_checkpointed(self, names: tuple[str, ...], args, kwargs):
        """The plan's note 5: each named module's forward under non-reentrant
        ``torch.utils.checkpoint`` (its random and autocast state kept for the recompute),
        for this forward only; the model's own code otherwise, unhooked."""
        patched = []
        try:
            for name in names:
                module = self.model.get_submodule(name)
                own = module.__dict__.get("forward")
                module.forward = functools.partial(_checkpointed, module.forward)
                patched.append((module, own))
            return self.forward(*args, **kwargs)
        finally:
            for module, own in patched:
                if own is None:
                    del module.forward
                else:
                    module.forward = own

    def _run(self, entry: _Entry, args, kwargs):
        state = StepState(entry.runtime)
        pack, unpack = make_hooks(state)
        mode = RunMode(state)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack), mode:
            out = self.forward(*args, **kwargs)
        state.end_forward()
        if state.diverged_at is not None:
            entry.stale = True
            warnings.warn(f"remat: this step diverged from the profiled one at op "
                          f"{state.diverged_at} ({state.divergence}); the next step with "
                          "these input shapes is profiled again", stacklevel=3)
        return out

    # ---- inspection ---------------------------------------------------------------------
    @property
    def plan(self) -> Optional[EagerPlan]:
        """The plan of the latest input signature, once planned."""
        for entry in reversed(self.entries.values()):
            if entry.plan is not None:
                return entry.plan
        return None

    def entry(self) -> Optional[_Entry]:
        for entry in reversed(self.entries.values()):
            if entry.plan is not None:
                return entry
        return None

    def table(self) -> str:
        """Per module: bytes kept, offloaded and recomputed, and the predicted peak."""
        entry = self.entry()
        if entry is None:
            return "remat: no plan yet (the first training step profiles the model)"
        return plan_table(entry.profile, entry.plan)

    def plot(self, path) -> None:
        """Draws the planned step's memory over time against the unplanned step's and the
        budget (``.svg`` or ``.png``), as ``remat plan --plot`` does; written atomically."""
        entry = self.entry()
        if entry is None:
            raise CaptureError("no plan yet: run two training steps first")
        plan = entry.plan
        unit = 1e-6  # the step graph's time unit (microseconds)

        def points(report):
            return [(t * unit, float(b)) for _, t, b in report["timeline"]]

        series = [("unplanned", points(plan.unplanned or plan.report))]
        if not plan.keeps_everything:
            series.append((f"remat ({plan.strategy})", points(plan.report)))
        _native.plot_timelines(os.fspath(path), f"eager step: predicted peak "
                               f"{_native.human_bytes(plan.predicted_peak)}", series,
                               plan.budget_bytes)

    def graph(self) -> StepGraph:
        """The profiled step as remat's graph (``.to_json()`` is what ``remat plan``
        reads)."""
        entry = self.entry() or next((e for e in reversed(self.entries.values())
                                      if e.profile is not None), None)
        if entry is None or entry.profile is None:
            raise CaptureError("no profiled step yet: run one training step first")
        return StepGraph(entry.profile, entry.static_bytes)


def plan_table(profile: Profile, plan: EagerPlan) -> str:
    rows: dict[str, list[int]] = collections.OrderedDict()
    seen: set[int] = set()
    for pack in profile.packs:
        vid = pack.ref.value
        if vid < 0 or vid in seen:
            continue
        seen.add(vid)
        row = rows.setdefault(pack.where, [0, 0, 0])
        kind = plan.decisions.get(vid, KEEP)
        row[{KEEP: 0, OFFLOAD: 1, RECOMPUTE: 2}[kind]] += profile.values[vid].nbytes
    h = _native.human_bytes
    width = max([len("module")] + [len(m) for m in rows])
    lines = [f"{'module':<{width}}  {'kept':>12}  {'offloaded':>12}  {'recomputed':>12}"]
    total = [0, 0, 0]
    for module, (k, o, r) in rows.items():
        lines.append(f"{module:<{width}}  {h(k):>12}  {h(o):>12}  {h(r):>12}")
        total = [total[0] + k, total[1] + o, total[2] + r]
    lines.append(f"{'total':<{width}}  {h(total[0]):>12}  {h(total[1]):>12}  {h(total[2]):>12}")
    lines.append(
        f"predicted peak {h(plan.predicted_peak)} (budget {h(plan.budget_bytes)}, unplanned "
        f"{h(plan.store_all_peak)}, static {h(plan.static_bytes)}), predicted overhead "
        f"{100 * plan.overhead:.2f}%, from {plan.strategy}")
    returned = sum(v.nbytes for v in profile.values if v.returned)
    held = sum(v.nbytes for v in profile.values if v.held_outside and not v.returned)
    if returned or held:
        # The profile's note 6: the worst a caller can keep, whatever the profiled one did.
        lines.append(f"kept by the caller: {h(returned)} the forward returned, charged as "
                     f"held through the backward (the worst case: a caller that drops it "
                     f"peaks lower)" + (f"; {h(held)} more held outside the model when its "
                                        "backward began" if held else ""))
    return "\n".join(lines)


def auto_checkpoint(model: torch.nn.Module, memory_budget: Any = 0.5, *,
                    offload: Optional[bool] = None, bandwidth: Optional[float] = None,
                    time_limit: Optional[float] = None, max_plans: int = 8,
                    strategy: Optional[str] = None, store=None, plan=None,
                    share_plan: bool = True) -> torch.nn.Module:
    """Plans keep / offload / recompute for ``model``'s training steps under
    ``memory_budget`` and runs the plan inside eager autograd. Returns ``model`` itself
    (same parameters, ``state_dict`` keys and attributes), its ``forward`` wrapped.

    memory_budget: int bytes or text ("8GiB", "1.5GB": the step's peak, static tensors and
        gradients included), or a float in (0, 1]: that fraction of the step's activation
        bytes.
    offload: False plans recompute only; None (default) offloads on CUDA where the planner
        finds it faster, and on CPU only to a ``store`` (the host is the same memory there).
    store: a directory where a CPU model's offloaded saved tensors are written, one file
        each, read back before the backward needs them and deleted then (the only way a
        CPU plan offloads; ``bandwidth`` defaults to the directory's measured throughput).
    bandwidth: host copy bytes per second for the planner, a number or text ("25GB/s",
        "12GiB/s": remat's one units parser); default: measured on CUDA.
    time_limit: seconds the planner may take per input signature (default: its own).
    strategy: one strategy of the Rust planner, or "checkpoint": the best plan that runs as
        ``torch.utils.checkpoint`` around whole modules, which remat picks by itself.
    max_plans: input signatures (shapes) whose plans are cached, least recent dropped
        (``controller(model).evictions`` counts them; the first is warned about).
    plan: a file written by ``controller(model).save(path)``: its plans run as they are,
        with no planning (each signature's first step is still profiled, as plain eager,
        and checked against the saved step). Checked against the model (parameters,
        buffers, module tree), the budget and each input signature; ``PlanMismatchError``
        names the file and what differs.
    share_plan: under an initialized ``torch.distributed`` with more than one rank, rank 0
        plans each input signature and every rank runs that plan (the planning step is a
        collective of the default group); False plans on each rank from its own timings.

    ```python
    import torch, torch.nn.functional as F
    import remat.torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        for _ in range(4)])
    x, y = torch.randn(128, 64), torch.randn(128, 64)
    model = remat.torch.auto_checkpoint(model, memory_budget=0.5)   # or "2GiB", or bytes
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(3):                      # the loop does not change
        F.mse_loss(model(x), y).backward()  # the same bits as plain eager
        opt.step(); opt.zero_grad()
    ```
    """
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(f"auto_checkpoint needs an nn.Module, got {type(model).__name__}")
    if isinstance(max_plans, bool) or not isinstance(max_plans, int) or max_plans < 1:
        raise CaptureError(f"max_plans must be a positive int, got {max_plans!r}")
    _check_budget(memory_budget)
    bandwidth = _parse_bandwidth(bandwidth)
    store = check_store(store) if store is not None else None
    if not isinstance(share_plan, bool):
        raise CaptureError(f"share_plan must be True or False, got {share_plan!r}")
    plans = _plan_file.read(plan, model, memory_budget) if plan is not None else None
    plan_source = os.fspath(plan) if plan is not None else ""
    existing = getattr(model, _ATTR, None)
    if existing is not None:  # called again: the new options, planned afresh
        existing.memory_budget = memory_budget
        existing.offload, existing.bandwidth = offload, bandwidth
        existing.time_limit, existing.strategy = time_limit, strategy
        existing.max_plans = max_plans
        existing.store = FileStore(store) if store is not None else None
        existing.loaded, existing.plan_source = plans, plan_source
        existing.share_plan = share_plan
        existing.entries.clear()
        return model
    controller = AutoCheckpoint(model, memory_budget, offload=offload, bandwidth=bandwidth,
                                time_limit=time_limit, max_plans=max_plans, strategy=strategy,
                                store=store, share_plan=share_plan, plans=plans,
                                plan_source=plan_source)
    object.__setattr__(model, _ATTR, controller)

    @functools.wraps(controller.forward)
    def forward(*args, **kwargs):
        return controller(*args, **kwargs)

    object.__setattr__(model, "forward", forward)
    return model


def controller(model: torch.nn.Module) -> AutoCheckpoint:
    """The :class:`AutoCheckpoint` of a model given to ``auto_checkpoint``.

    ```python
    import torch, torch.nn.functional as F
    import remat.torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        for _ in range(4)])
    x, y = torch.randn(128, 64), torch.randn(128, 64)
    remat.torch.auto_checkpoint(model, 0.5)
    for _ in range(2):                      # profiled, then planned and run
        F.mse_loss(model(x), y).backward()
    print(remat.torch.controller(model).table())
    ```
    """
    c = getattr(model, _ATTR, None)
    if c is None:
        raise CaptureError(f"{type(model).__name__} was not given to auto_checkpoint")
    return c


def _checkpointed(forward, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _parse_bandwidth(bandwidth) -> Optional[float]:
    """``bandwidth`` as bytes per second, read as every remat front end reads it."""
    if bandwidth is None:
        return None
    return float(_arguments.bandwidth(bandwidth, "bandwidth"))


def _check_budget(budget) -> None:
    """Refuses, when given, a budget no step can mean (unreadable text, 0, a negative, a
    fraction outside (0, 1], bytes under 1 KiB), in the words and class (``ArgumentError``)
    every remat front end uses for the same value."""
    _arguments.check_step_budget(budget, "memory_budget")


def _signature(model, args, kwargs) -> tuple:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    parts = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            parts.append(("t", tuple(x.shape), x.dtype, x.device, x.requires_grad))
        elif x is None or isinstance(x, (bool, int, float, str)):
            parts.append(("c", type(x).__name__, x))
        else:
            parts.append(("o", type(x).__name__))
    device = _device_of(model)
    autocast = (torch.is_autocast_enabled(device.type),
                torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type)
                else None)
    return (str(spec), tuple(parts), autocast)


def _quantized_rate(bytes_per_s: float) -> float:
    """A measured bandwidth on the grid of the profile's times (``_eager_graph.quantized``):
    the time a copy takes is what plans compare, and it must not follow the noise."""
    return 1.0 / quantized(1.0 / bytes_per_s) if bytes_per_s > 0 else bytes_per_s


def _nothing() -> None:
    return None


@functools.lru_cache(maxsize=8)
def _measure_copy_bandwidth(device: torch.device) -> float:
    """Pinned host -> device bytes per second, measured once per device (32 MiB, median of
    three copies)."""
    n = 32 << 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return n / max(sorted(times)[1], 1e-9)
