"""Plans of ``torch.utils.checkpoint``'s family, drawn from the module tree: each module's run
of ops a segment rebuilt from its inputs, then kept values added back by their cost per
byte; judged as checkpoint runs them where they rebuild whole called modules (``_eager_plan``
note 5)."""

from __future__ import annotations

import bisect
import dataclasses
import time
from typing import Optional

import torch
import torch.utils.checkpoint

from .. import _native
from ..errors import BudgetError
from ._eager_profile import Profile
from ._eager_graph import (EagerPlan, KEEP, OFFLOAD, RECOMPUTE, TIME_UNIT_S, _recipes, _refs,
                           recipe)
from ._eager_schedule import (_evaluate, _evaluate_as, checkpoint_call_seconds, positions_of,
                              rebuild_groups, rebuild_triggers)


def _recompute_everything(sg, bandwidth, budget_bytes, store_all) -> EagerPlan:
    """The least-memory recompute-only plan of a simple family: every ``k``-th saved value
    (in forward order) held as an anchor, every other one rebuilt from the anchors before
    it, for several ``k`` (every saved value rebuilt from the statics among them). Used where
    the planner's proposals do not fit, and to name the least peak reachable."""
    profile = sg.profile
    saved = [v for v in profile.values if v.saved and v.first_unpack is not None]
    rebuildable = [v for v in saved if v.recomputable]
    best: Optional[EagerPlan] = None
    strides = sorted({2, 3, 4, 6, 8, max(2, int(len(rebuildable) ** 0.5)), len(saved) + 1})
    for k in strides:
        decisions, anchors = {}, set()
        for i, value in enumerate(rebuildable):
            if i % k == k - 1:
                decisions[value.id] = KEEP
                anchors.add(value.id)
            else:
                decisions[value.id] = RECOMPUTE
        for value in saved:
            if not value.recomputable:
                decisions[value.id] = KEEP
                anchors.add(value.id)
        recipes = _recipes(profile, decisions, anchors)
        plan = _evaluate(sg, decisions, recipes, {}, bandwidth, budget_bytes,
                         f"eager-segments:{k}", store_all, anchors)
        if best is None or (plan.predicted_peak, plan.overhead) < (best.predicted_peak,
                                                                   best.overhead):
            best = plan
    return best

def _segments_at(profile: Profile, depth: int) -> list[list[int]]:
    """Forward ops grouped into segments: maximal runs of consecutive ops that ran inside
    the same module ``depth`` levels below the model (``model.layers.3`` at depth 3);
    ops above that depth belong to none."""
    segments: list[list[int]] = []
    current_key = None
    for op in profile.ops[:profile.forward_ops]:
        parts = op.where.split(".")
        key = ".".join(parts[:depth]) if len(parts) >= depth and "." in op.where else None
        if key is None:
            current_key = None
            continue
        if key != current_key:
            segments.append([])
            current_key = key
        segments[-1].append(op.index)
    return segments

def _segment_plan(sg, segments, keep_inside: set[int]):
    """Decisions and anchors of a segmented plan: every saved value made inside a segment
    is rebuilt (from the values the segment reads from outside it, held as anchors), but
    those in ``keep_inside``; saved values made outside every segment are kept."""
    profile = sg.profile
    values = profile.values
    segment_of: dict[int, int] = {}
    for k, ops in enumerate(segments):
        for i in ops:
            segment_of[i] = k
    decisions: dict[int, str] = {}
    anchors: set[int] = set()
    for value in values:
        if not value.saved or value.first_unpack is None:
            continue
        inside = value.op in segment_of
        if inside and value.recomputable and value.id not in keep_inside:
            decisions[value.id] = RECOMPUTE
        else:
            decisions[value.id] = KEEP
            anchors.add(value.id)
    for op in profile.ops[:profile.forward_ops]:
        k = segment_of.get(op.index)
        for ref in _refs(op.leaves):
            if ref.value >= 0 and segment_of.get(values[ref.value].op) != k:
                anchors.add(ref.value)
    # A segment's output that ops outside it read is held for them (an anchor), so it is
    # kept where autograd saves it too, not rebuilt.
    for a in anchors:
        if decisions.get(a) == RECOMPUTE:
            decisions[a] = KEEP
    return decisions, anchors

def _module_segments(sg, bandwidth, budget_bytes, store_all) -> list[EagerPlan]:
    """Plans of the family ``torch.utils.checkpoint`` draws from, found by the module tree:
    at each depth, every module's run of ops is a segment rebuilt from its inputs (note 4:
    once per segment). Where that fits the budget with room to spare, the saved values
    dearest to rebuild per byte (a matmul's output before an activation's) are kept
    instead, as many as still fit: the most a budget allows, fewer rebuilt ops than a
    per-block checkpoint."""
    profile = sg.profile
    depths = {len(op.where.split(".")) for op in profile.ops[:profile.forward_ops]
              if "." in op.where}
    plans: list[EagerPlan] = []
    for depth in sorted(depths):
        segments = [s for s in _segments_at(profile, depth) if s]
        if not segments:
            continue
        plan = _evaluate_segments(sg, segments, set(), bandwidth, budget_bytes, store_all,
                                  depth)
        if not plan.count(RECOMPUTE):
            continue
        plans.append(plan)
        checkpointed = _as_checkpointed_where_safe(sg, segments, plan, bandwidth,
                                                   budget_bytes, store_all, depth)
        if checkpointed is not None:
            plans.append(checkpointed)
        if bandwidth:
            offloaded = _offload_anchors(sg, plan, bandwidth, budget_bytes, store_all)
            if offloaded is not None:
                plans.append(offloaded)
        if plan.predicted_peak > budget_bytes:
            continue
        plans.append(_relax(sg, segments, plan, bandwidth, budget_bytes, store_all, depth))
    return plans

def _offload_anchors(sg, plan: EagerPlan, bandwidth, budget_bytes, store_all
                     ) -> Optional[EagerPlan]:
    """``plan`` with its anchors offloaded where autograd saves them (the plan's note 7):
    each segment rebuilt from an input that waits on the host, fetched back while the
    rebuild before it in the backward runs (checkpoint each layer, offload its input).
    None where no anchor can go (not saved, written in the backward, or read again by the
    forward until its first rebuild)."""
    values = sg.profile.values
    groups, group_recipes = rebuild_groups(plan.decisions, plan.recipes, True)
    trigger, first_use = rebuild_triggers(values, groups, group_recipes)
    starts = sorted(set(trigger.values()))
    decisions, prefetch = dict(plan.decisions), {}
    for a, use in first_use.items():
        value = values[a]
        if (plan.decisions.get(a) != KEEP or not value.saved or value.first_unpack is None
                or any(w >= sg.profile.forward_ops for w in value.writers)):
            continue
        use = min(use, value.first_unpack)
        if value.python_death is None or value.python_death >= use:
            continue
        decisions[a] = OFFLOAD
        before = bisect.bisect_left(starts, use) - 1
        prefetch[a] = max(starts[before], value.python_death) if before >= 0 else use
    if not prefetch:
        return None
    name = plan.strategy.removesuffix("/alone") + "+offload"
    return _evaluate(sg, decisions, plan.recipes, prefetch, bandwidth, budget_bytes, name,
                     store_all)

def _as_checkpointed_where_safe(sg, segments, plan: EagerPlan, bandwidth, budget_bytes,
                                store_all, depth) -> Optional[EagerPlan]:
    """The segmented ``plan`` run by ``torch.utils.checkpoint``, its segments narrowed to
    the modules a re-run leaves as they were (:func:`_rerun_changes`: the others' ops run
    as they are, their saved values kept), or None where no module is left."""
    profile = sg.profile
    names = _checkpointable(profile, segments, depth)
    if not names:
        return None
    safe = [ops for ops, name in zip(segments, names) if not _rerun_changes(profile, name)]
    if len(safe) < len(segments):
        if not safe:
            return None
        plan = _evaluate_segments(sg, safe, set(), bandwidth, budget_bytes, store_all, depth)
        if not plan.count(RECOMPUTE):
            return None
        segments = safe
    module_of, together = _rebuilt_modules(profile, segments, depth, plan)
    if not module_of:
        return None
    return _as_checkpointed(sg, plan, module_of, together, bandwidth, budget_bytes, store_all,
                            depth)

def _rerun_changes(profile: Profile, name: str) -> str:
    """Why re-running module ``name``'s forward in the backward, as ``torch.utils.checkpoint``
    does, would change what the caller sees ("" where it would not): its call changed an
    object it was given (a key/value cache it appends to: the profile's note 7), or it saves
    a tensor the caller holds through the backward, which the re-run would make a second
    copy of (note 6)."""
    inside = name + "."
    for module, what in profile.module_writes.items():
        if module == name:
            return f"its forward changed {what}"
        if module.startswith(inside):
            return f"{module}'s forward changed {what}"
    held = {pack.where for pack in profile.packs
            if pack.ref.value >= 0 and profile.values[pack.ref.value].held_outside}
    if any(where == name or where.startswith(inside) for where in held):
        return "it saves a tensor the caller holds through the backward"
    return ""

def _as_checkpointed(sg, plan: EagerPlan, module_of: dict[int, str],
                     together: dict[int, int], bandwidth, budget_bytes, store_all,
                     depth) -> EagerPlan:
    """``plan`` run by ``torch.utils.checkpoint`` around the module of each of its groups
    (note 5): each module's rebuilt values one group (``together``: checkpoint rebuilds
    them at once), its frame holding the module's arguments longer than remat's groups hold
    their anchors, and each call costing what the checkpoint machinery costs in Python, in
    place of the dispatch mode's per-op cost."""
    frames = {g: sg.profile.module_inputs.get(name, ()) for g, name in module_of.items()}
    run = _evaluate_as(sg, plan.decisions, plan.recipes, {}, bandwidth, budget_bytes,
                       f"checkpoint:depth{depth}", store_all, True, frames=frames,
                       together=together)
    base = run.report["base_time"] * TIME_UNIT_S
    calls = len(module_of) * checkpoint_call_seconds() / base if base > 0 else 0.0
    modules = tuple(module_of[g] for g in sorted(
        module_of, key=lambda g: run.group_recipes[g].ops[0]))
    return dataclasses.replace(run, checkpoint_modules=modules, hook_overhead=calls)

def _checkpoint_only(sg, bandwidth, budget_bytes, store_all, keep_all) -> EagerPlan:
    """The cheapest plan run by ``torch.utils.checkpoint`` around modules that fits."""
    plans = [p for p in _module_segments(sg, bandwidth, budget_bytes, store_all)
             if p.checkpoint_modules]
    fits = [p for p in plans if p.predicted_peak <= budget_bytes]
    if fits:
        best = min(fits, key=lambda p: p.cost)
        best.unplanned = keep_all.report
        return best
    least = min((p.predicted_peak for p in plans), default=keep_all.predicted_peak)
    raise BudgetError(
        f"memory_budget {_native.human_bytes(budget_bytes)}: no plan of checkpointed modules "
        f"fits; the least such peak is {_native.human_bytes(least)}"
        + ("" if plans else " (no module's calls are whole segments: the step keeps all)"),
        budget_bytes=budget_bytes, best_peak=least, floor_bytes=least)

def _rebuilt_modules(profile: Profile, segments, depth: int, plan: EagerPlan
                     ) -> tuple[dict[int, str], dict[int, int]]:
    """The modules to run under ``torch.utils.checkpoint`` for a segmented ``plan``, by the
    group each rebuilds, and the grouping that makes each module's rebuilt values one group
    (value -> segment: checkpoint rebuilds a module at once); a segment that rebuilds
    nothing runs as it is (autograd keeps what it saves, as the plan does). Empty when the
    segments are no module calls or a group's recipe reaches beyond its segment."""
    names = _checkpointable(profile, segments, depth)
    if not names:
        return {}, {}
    segment_of = {i: k for k, ops in enumerate(segments) for i in ops}
    together = {v: segment_of[profile.values[v].op] for v, d in plan.decisions.items()
                if d == RECOMPUTE and profile.values[v].op in segment_of}
    _, group_recipes = rebuild_groups(plan.decisions, plan.recipes, True, together)
    module_of: dict[int, str] = {}
    for g, recipe in group_recipes.items():
        ks = {segment_of.get(i) for i in recipe.ops}
        if len(ks) != 1 or None in ks:
            return {}, {}
        module_of[g] = names[ks.pop()]
    return module_of, together

def _checkpointable(profile: Profile, segments, depth: int) -> tuple[str, ...]:
    """The modules (qualified names) whose calls are exactly ``segments``, one call each,
    or () when some segment is no single module call (a container's children, never
    called themselves; a module called twice)."""
    names = []
    for ops in segments:
        keys = {".".join(profile.ops[i].where.split(".")[:depth]) for i in ops}
        if len(keys) != 1:
            return ()
        name = keys.pop()
        if profile.module_calls.get(name) != 1:
            return ()
        names.append(name)
    if len(set(names)) != len(names):
        return ()
    return tuple(names)

def _evaluate_segments(sg, segments, keep_inside, bandwidth, budget_bytes, store_all,
                       depth) -> EagerPlan:
    decisions, anchors = _segment_plan(sg, segments, keep_inside)
    recipes = _recipes(sg.profile, decisions, anchors)
    name = f"segments:depth{depth}" + (f"+keep{len(keep_inside)}" if keep_inside else "")
    return _evaluate(sg, decisions, recipes, {}, bandwidth, budget_bytes, name, store_all,
                     anchors)

def _relax(sg, segments, plan, bandwidth, budget_bytes, store_all, depth) -> EagerPlan:
    """Keeps the most rebuilt values that still fit the budget, dearest to rebuild per byte
    first (bisection on how many: the peak grows with them)."""
    profile = sg.profile
    rebuilt = [profile.values[v] for v, d in plan.decisions.items() if d == RECOMPUTE]
    rebuilt.sort(key=lambda v: -sg.seconds[v.op] / max(1, v.nbytes))
    best, low, high = plan, 0, len(rebuilt)
    while low < high:
        mid = (low + high + 1) // 2
        candidate = _evaluate_segments(sg, segments, {v.id for v in rebuilt[:mid]},
                                       bandwidth, budget_bytes, store_all, depth)
        if candidate.predicted_peak <= budget_bytes:
            low = mid
            if candidate.cost < best.cost:
                best = candidate
        else:
            high = mid - 1
    return best

def _descend(sg, plan: EagerPlan, bandwidth, budget_bytes, store_all,
             rounds: int = 64) -> EagerPlan:
    """Lowers a plan's peak one saved value at a time: at the simulated peak, the largest
    kept value that only autograd holds there is rebuilt instead, while that lowers the
    peak. Every candidate is judged by the simulator on the eager schedule."""
    profile = sg.profile
    values = profile.values
    current = plan
    for _ in range(rounds):
        if current.predicted_peak <= budget_bytes:
            break
        at = positions_of(sg, current)[current.report["peak_step"]]
        pool = [v for v in values
                if current.decisions.get(v.id) == KEEP and v.recomputable and v.saved
                and v.first_unpack is not None and v.python_death <= at < v.expiry]
        pool.sort(key=lambda v: -v.nbytes)
        improved = False
        for value in pool[:12]:
            decisions = dict(current.decisions)
            decisions[value.id] = RECOMPUTE
            anchors = {u for u, d in decisions.items() if d == KEEP}
            recipes = _recipes(profile, decisions, anchors)
            candidate = _evaluate(sg, decisions, recipes, current.prefetch_at, bandwidth,
                                  budget_bytes, current.strategy + "+descent", store_all,
                                  anchors)
            if candidate.predicted_peak < current.predicted_peak:
                current = candidate
                improved = True
                break
        if not improved:
            break
    return current
