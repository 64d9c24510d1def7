"""A plan as data: what ``controller(model).save(path)`` writes, what
``auto_checkpoint(..., plan=path)`` reads, and what one rank sends the others.

A plan is decisions about a profiled step's values (value ids are positions in the profile),
so it is bound to a step with the same ops and values: a *record* holds the decisions, the
rebuild recipes and groups exactly as planned, and the step's structure (each op's name,
module and a digest of its tensors' shapes, strides, dtypes and value ids; each value's
creator, size and what autograd saved). A run from a record still profiles its first step
with each input signature (that step runs as plain eager, as every first step does): the
runtime replays the recorded ops of *this* process, its static tensors and constants, so
the step's own profile is what the decisions are bound to, after checking that its
structure is the recorded one. Nothing is re-planned: the planner and its timings are not
consulted, only remat's simulator, for the predicted peak of this process's step (the same
bytes; times are this process's own).

Gradients stay bit-identical to eager for the reason they are with a fresh plan: every
rebuild replays the step's own recorded ops on the step's own tensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from .. import _native
from ._eager_graph import (KEEP, OFFLOAD, RECOMPUTE, EagerPlan, Recipe, StepGraph,
                           mark_recomputable)
from ._eager_profile import Profile, TensorRef
from ._eager_schedule import _evaluate, eager_schedule, with_workspace
from .errors import PlanMismatchError

FORMAT = "remat-eager-plan"
VERSION = 1
KINDS = (KEEP, RECOMPUTE, OFFLOAD)


# ---- the step's structure ------------------------------------------------------------------


def _ref_text(x, replayable: bool = True) -> Any:
    if isinstance(x, TensorRef):
        if x.value < 0 or not replayable:
            # A static is read as this step's tensor, wherever it lies (a rank's shard of a
            # parameter is at its own offset); an op no rebuild replays (a collective, a
            # backward op) is structure only through the values it reads and makes.
            return [x.value, x.static, str(x.dtype)] if replayable else [x.value]
        return [x.value, list(x.size), list(x.stride), x.offset, str(x.dtype), x.version]
    if x is None:
        return None
    # A constant's value may change from step to step (the runtime passes this step's):
    # only its kind is structure.
    return type(x).__name__


def structure(profile: Profile) -> list[list]:
    """Per op: [name, phase, module or autograd node, digest of its tensors and values]."""
    ops = []
    made: dict[int, list] = {}
    for v in profile.values:
        made.setdefault(v.op, []).append(
            [v.id, v.nbytes, list(v.writers), v.saved, v.first_unpack])
    for op in profile.ops:
        # Only forward ops are ever replayed: a backward op's tensors matter through the
        # values it reads and makes (FSDP copies each rank's gradient shard at its offset).
        replayed = op.replayable and op.phase == "forward"
        text = json.dumps([[_ref_text(x, replayed) for x in op.leaves],
                           [_ref_text(x, replayed) for x in op.outputs], op.new_values,
                           list(op.written), list(op.static_writes), op.replayable,
                           op.random, made.get(op.index, [])], separators=(",", ":"))
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        ops.append([op.name, op.phase, op.where, digest])
    return ops


def fingerprint(ops: list[list]) -> str:
    """One digest of :func:`structure`'s rows, and the step's split into forward and
    backward."""
    return hashlib.sha256(json.dumps(ops, separators=(",", ":")).encode()).hexdigest()


def first_difference(mine: list[list], theirs: list[list]) -> str:
    """Where two structures part, in words."""
    if len(mine) != len(theirs):
        lead = f"{len(theirs)} ops there, {len(mine)} here"
    else:
        lead = f"{len(mine)} ops in both"
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            if a[:3] != b[:3]:
                return (f"{lead}; op {i} is {b[0]} ({b[1]}, in {b[2]}) there and {a[0]} "
                        f"({a[1]}, in {a[2]}) here")
            return (f"{lead}; op {i} ({a[0]} in {a[2]}) has other tensor shapes, strides, "
                    "dtypes or saved values")
    return lead


def model_description(model: torch.nn.Module) -> dict:
    """What a plan file is checked against: every parameter's and buffer's name, shape and
    dtype, and the module tree (qualified names and classes)."""
    return {
        "parameters": [[n, list(p.shape), str(p.dtype)] for n, p in model.named_parameters()],
        "buffers": [[n, list(b.shape), str(b.dtype)] for n, b in model.named_buffers()],
        "modules": [[n, type(m).__name__] for n, m in model.named_modules()],
    }


def describe_mismatch(mine: dict, theirs: dict) -> Optional[str]:
    """The first difference between two model descriptions, in words; None when equal."""
    for part in ("parameters", "buffers", "modules"):
        a = {row[0]: row[1:] for row in mine.get(part, [])}
        b = {row[0]: row[1:] for row in theirs.get(part, [])}
        if a == b:
            continue
        missing = [n for n in b if n not in a]
        extra = [n for n in a if n not in b]
        if missing:
            return f"{part}: {missing[0]!r} is in the plan's model, not in this one"
        if extra:
            return f"{part}: {extra[0]!r} is in this model, not in the plan's"
        name = next(n for n in a if a[n] != b[n])
        return f"{part}: {name!r} is {b[name]} in the plan's model and {a[name]} here"
    return None


def signature_text(key: tuple) -> str:
    """An input signature as text that is the same in every process: devices by their
    type only (rank 1's ``cuda:1`` is rank 0's ``cuda:0``)."""
    spec, parts, autocast = key

    def part(p):
        if p[0] == "t":
            return ["t", list(p[1]), str(p[2]), p[3].type, p[4]]
        return [str(x) for x in p]

    return json.dumps([spec, [part(p) for p in parts], [autocast[0], str(autocast[1])]],
                      separators=(",", ":"))


# ---- a plan as a record --------------------------------------------------------------------


def _ids(d: dict) -> dict:
    return {str(k): v for k, v in sorted(d.items())}


def _recipe_rows(recipes: dict[int, Recipe]) -> dict:
    return {str(k): [list(r.ops), list(r.anchors)] for k, r in sorted(recipes.items())}


def record_of(plan: EagerPlan, ops: list[list], signature: str, memory_budget,
              bandwidth: Optional[float], frames: dict[int, tuple[int, ...]]) -> dict:
    """The plan of one input signature as JSON-ready data."""
    return {
        "signature": signature,
        "fingerprint": fingerprint(ops),
        "ops": ops,
        "memory_budget": memory_budget,
        "budget_bytes": plan.budget_bytes,
        "bandwidth": bandwidth,
        "strategy": plan.strategy,
        "predicted_peak": plan.predicted_peak,
        "decisions": _ids(plan.decisions),
        "recipes": _recipe_rows(plan.recipes),
        "anchors": sorted(plan.anchors),
        "prefetch_at": _ids(plan.prefetch_at),
        "groups": _ids(plan.groups),
        "group_recipes": _recipe_rows(plan.group_recipes),
        "checkpoint_modules": list(plan.checkpoint_modules),
        "frames": {str(g): list(v) for g, v in sorted(frames.items())},
        "hook_overhead": plan.hook_overhead,
    }


def _int_keys(d: dict) -> dict:
    return {int(k): v for k, v in d.items()}


def _recipes_from(rows: dict) -> dict[int, Recipe]:
    return {int(k): Recipe([int(i) for i in r[0]], [int(a) for a in r[1]])
            for k, r in rows.items()}


def bind(profile: Profile, static_bytes: int, record: dict, *, source: str) -> EagerPlan:
    """The recorded plan on this process's profiled step, after checking that the step is
    the recorded one (``source`` names where the record came from in errors). The
    predicted peak is the simulator's on this step."""
    ops = structure(profile)
    if fingerprint(ops) != record["fingerprint"]:
        raise PlanMismatchError(
            f"{source}: the plan for this input signature was made for another step: "
            f"{first_difference(ops, record['ops'])}", source=source, field="step")
    mark_recomputable(profile)
    sg = StepGraph(profile, static_bytes)
    decisions = _int_keys(record["decisions"])
    if any(k not in KINDS for k in decisions.values()):
        bad = next(k for k in decisions.values() if k not in KINDS)
        raise PlanMismatchError(f"{source}: unknown decision {bad!r} (known: "
                                f"{', '.join(KINDS)})", source=source, field="decisions")
    recipes = _recipes_from(record["recipes"])
    prefetch = {int(k): int(v) for k, v in record["prefetch_at"].items()}
    groups = {int(k): int(v) for k, v in record["groups"].items()}
    group_recipes = _recipes_from(record["group_recipes"])
    frames = {int(g): tuple(v) for g, v in record["frames"].items()} or None
    bandwidth = record["bandwidth"]
    store_all_plan = _evaluate(sg, {}, {}, {}, bandwidth, 0, "keep", sg.graph.store_all_peak)
    store_all = max(sg.graph.store_all_peak, store_all_plan.predicted_peak)
    steps = eager_schedule(sg, decisions, prefetch, groups, group_recipes, frames)
    report = with_workspace(sg, steps, _native.simulate(sg.graph._native, steps,
                                                        float(bandwidth or 1.0)))
    base = report["base_time"]
    return EagerPlan(
        decisions=decisions, recipes=recipes, anchors=set(record["anchors"]),
        prefetch_at=prefetch, predicted_peak=int(report["peak_bytes"]),
        store_all_peak=store_all, budget_bytes=int(record["budget_bytes"]),
        static_bytes=static_bytes,
        overhead=(report["total_time"] - base) / base if base > 0 else 0.0,
        strategy=record["strategy"], report=report, steps=steps,
        unplanned=store_all_plan.report, groups=groups, group_recipes=group_recipes,
        checkpoint_modules=tuple(record["checkpoint_modules"]),
        hook_overhead=float(record["hook_overhead"]),
    )


def frames_of(profile: Profile, plan: EagerPlan) -> dict[int, tuple[int, ...]]:
    """A checkpointed-module plan's frames (``_eager_segments._as_checkpointed``): per
    group, the values among its module's arguments."""
    if not plan.checkpoint_modules:
        return {}
    groups = sorted(plan.group_recipes, key=lambda g: plan.group_recipes[g].ops[0])
    return {g: profile.module_inputs.get(name, ())
            for g, name in zip(groups, plan.checkpoint_modules)}


# ---- the file ------------------------------------------------------------------------------


def write(path: Path, model: torch.nn.Module, records: list[dict]) -> None:
    """The plan file, all or nothing: a temporary name in the same directory, synced,
    renamed."""
    doc = {"format": FORMAT, "version": VERSION, "torch": torch.__version__,
           "model": model_description(model), "plans": records}
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp",
                               dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:  # the rename itself, durable
        dir_fd = os.open(path.parent if str(path.parent) else ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read(path: Path, model: torch.nn.Module, memory_budget) -> dict[str, dict]:
    """The plans of a plan file by input signature, checked against ``model`` and the
    budget they were made for."""
    path = Path(path)
    source = os.fspath(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise PlanMismatchError(f"plan {source}: cannot be read ({e.strerror or e})",
                                source=source, field="file") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanMismatchError(f"plan {source}: not JSON ({e.msg} at line {e.lineno})",
                                source=source, field="file") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise PlanMismatchError(f"plan {source}: not a remat eager plan (no \"format\": "
                                f"\"{FORMAT}\")", source=source, field="format")
    if doc.get("version") != VERSION:
        raise PlanMismatchError(f"plan {source}: version {doc.get('version')!r}; this remat "
                                f"reads version {VERSION}", source=source, field="version")
    differs = describe_mismatch(model_description(model), doc.get("model", {}))
    if differs is not None:
        raise PlanMismatchError(f"plan {source} was made for another model: {differs}",
                                source=source, field="model")
    plans: dict[str, dict] = {}
    for record in doc.get("plans", []):
        if record.get("memory_budget") != memory_budget:
            raise PlanMismatchError(
                f"plan {source} was made for memory_budget {record.get('memory_budget')!r}, "
                f"not {memory_budget!r}: give auto_checkpoint the same budget, or plan "
                "afresh without plan=", source=source, field="memory_budget")
        plans[record["signature"]] = record
    if not plans:
        raise PlanMismatchError(f"plan {source} holds no plan", source=source, field="plans")
    return plans
