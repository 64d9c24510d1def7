"""What eager autograd really runs under a plan's decisions (:func:`eager_schedule`), in the
simulator's language, and the plan judged by remat's simulator on that schedule; the
measured per-call costs of the dispatch mode and of ``torch.utils.checkpoint``. See
``_eager_plan``'s notes 1, 4 and 5."""

from __future__ import annotations

import bisect
import functools
import re
import time
from typing import Optional

import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _native
from ._eager_graph import (EagerPlan, KEEP, OFFLOAD, RECOMPUTE, Recipe, StepGraph, TIME_UNIT_S,
                           quantized)


def eager_schedule(sg: StepGraph, decisions: dict[int, str], prefetch_at: dict[int, int],
                   groups: dict[int, int], group_recipes: dict[int, Recipe],
                   frames: Optional[dict[int, tuple[int, ...]]] = None
                   ) -> list[tuple[str, int]]:
    """The steps eager autograd takes under ``decisions`` (see the notes in ``_eager_plan``), in the
    simulator's language. A value's bytes belong to its op's node; positions are ops (notes
    in ``_eager_plan``).

    ``frames``: the groups run as ``torch.utils.checkpoint`` runs a module (note 5), each
    with the values among its module's arguments: its frame holds them (the group's anchors
    and whatever else the call was given, an attention mask, positions) until autograd has
    released the last tensor the module saved, not only until the rebuild as remat's own
    runtime does."""
    profile = sg.profile
    values = profile.values
    n = sg.n
    # The runtime sees the backward only through unpacks: a prefetch is issued at the
    # unpack at or before its planned position (``_eager_run``), and is charged there.
    unpacks = sorted({p for pack in profile.packs for p in pack.unpacks})
    members: dict[int, list[int]] = {}
    for v, g in groups.items():
        members.setdefault(g, []).append(v)
    trigger, first_anchor_use = rebuild_triggers(values, groups, group_recipes, frames)
    last_anchor_use: dict[int, int] = {}
    for g, r in group_recipes.items():
        until = trigger[g]
        held = set(r.anchors)
        if frames is not None:
            until = max(until, max(values[v].expiry for v in members[g]) - 1)
            held.update(frames.get(g, ()))
        for a in held:
            last_anchor_use[a] = max(last_anchor_use.get(a, 0), until)
    forward_ops = profile.forward_ops
    by_node: dict[int, list[int]] = {}  # the values of each forward node (op or part)
    own_frees_at: dict[int, list[int]] = {}  # position -> backward sum and part nodes gone
    for value in values:
        if value.id in sg.sum_node and value.op >= forward_ops:
            gone = sg.expiry(value.id) if value.expiry is not None else n
            if gone < n:
                own_frees_at.setdefault(gone, []).append(sg.sum_node[value.id])
        else:
            by_node.setdefault(sg.node_of(value.id), []).append(value.id)
    release: dict[int, int] = {}  # node -> position it leaves the device for good
    early: dict[int, int] = {}  # node -> position it leaves the device after the forward
    back_at: dict[int, list[tuple[str, int]]] = {}  # position -> (how, node) coming back
    for nd, vids in by_node.items():
        expiry = max(sg.expiry(v) for v in vids)
        anchor_until = max((last_anchor_use.get(v, -1) + 1 for v in vids), default=-1)
        release[nd] = max(expiry, anchor_until)
        kinds = {decisions.get(v, KEEP) for v in vids}
        moved = kinds & {RECOMPUTE, OFFLOAD}
        if not moved or KEEP in kinds or len(moved) > 1:
            continue
        # An anchor leaves only offloaded (note 7), and only where no checkpoint frame
        # holds it: it comes back before the first rebuild that reads it.
        anchored = [v for v in vids if v in last_anchor_use]
        if anchored and (moved != {OFFLOAD} or frames is not None):
            continue
        death = max(values[v].python_death for v in vids)
        comeback = min([values[v].first_unpack for v in vids if decisions.get(v) in moved]
                       + [first_anchor_use[v] for v in anchored])
        if death >= comeback:
            continue
        early[nd] = death
        if OFFLOAD in moved:
            at = min([prefetch_at[v] for v in vids if v in prefetch_at] + [comeback])
            back_at.setdefault(max(_issued_at(unpacks, at), death), []).append(("swap_in", nd))
        # A rebuilt node comes back with its group, at the group's trigger (below).
    for g, at in trigger.items():
        back_at.setdefault(at, []).append(("group", g))
    frees_at: dict[int, list[int]] = {}
    for nd, p in release.items():
        if p < n:
            frees_at.setdefault(p, []).append(nd)
    early_at: dict[int, list[int]] = {}
    for nd, p in early.items():
        early_at.setdefault(p, []).append(nd)
    steps: list[tuple[str, int]] = []
    resident: set[int] = set()  # nodes on the device

    def free(nd: int) -> None:
        if nd in resident:
            steps.append(("free", nd))
            resident.discard(nd)

    for p in range(n):
        # What is gone by position p left before anything comes back at p: a value
        # expires at p when the node that read it last released its saved tensors, and
        # autograd does that before the next node unpacks (which is what triggers a
        # rebuild or waits on a prefetch). Freeing after the comebacks would charge a
        # rebuild with the bytes of the node before it (the last saved value of a stem,
        # rebuilt while the next one is still counted).
        # Autograd summed the gradients op p reads first while the summands were alive.
        for v in sg.sums.get(p, ()):
            steps.append(("compute", sg.sum_node[v]))
            resident.add(sg.sum_node[v])
        for nd in early_at.get(p, ()):
            free(nd)
        for nd in own_frees_at.get(p, ()):
            free(nd)
        for nd in frees_at.get(p, ()):
            free(nd)
        # Prefetches first: the runtime starts them at an unpack before the unpack's own
        # rebuild, which may read what they bring (an offloaded anchor).
        for how, x in sorted(back_at.get(p, ()), key=lambda b: (b[0] != "swap_in", b[1])):
            if how == "swap_in":
                steps.append(("swap_in", x))
                resident.add(x)
            else:
                _recompute_steps(sg, group_recipes[x].ops, steps, resident,
                                 {sg.node_of(u) for u in members[x]}, frames is not None)
        made = [sg.op_node[p]] + [sg.sum_node[v] for v in sg.parts.get(p, ())]
        for nd in made:
            steps.append(("compute", nd))
            resident.add(nd)
        for nd in made:
            if nd in early and any(decisions.get(v) == OFFLOAD for v in by_node[nd]):
                steps.append(("swap_out", nd))
        if sg.bytes[sg.op_node[p]] == 0:
            # Owns nothing (a view, an in-place write): no residency, and a rebuild may run it
            # again.
            free(sg.op_node[p])
        if p in sg.hold_node:
            steps.append(("compute", sg.hold_node[p]))
            steps.append(("free", sg.hold_node[p]))
    steps.append(("compute", sg.end))
    return steps

def _issued_at(unpacks: list[int], position: int) -> int:
    """Where the runtime issues a prefetch planned at ``position``: at the last unpack at or
    before it, or at the first unpack when none is (``RuntimePlan.prefetch_after``)."""
    k = bisect.bisect_right(unpacks, position) - 1
    if k >= 0:
        return unpacks[k]
    return unpacks[0] if unpacks else position


def rebuild_triggers(values, groups: dict[int, int], group_recipes: dict[int, Recipe],
                     frames: Optional[dict[int, tuple[int, ...]]] = None
                     ) -> tuple[dict[int, int], dict[int, int]]:
    """Group -> the position of its rebuild (the first unpack of any member: note 4), and
    anchor -> the first rebuild that reads it (or whose checkpoint frame holds it)."""
    trigger: dict[int, int] = {}
    for v, g in groups.items():
        trigger[g] = min(trigger.get(g, values[v].first_unpack), values[v].first_unpack)
    first_read: dict[int, int] = {}
    for g, r in group_recipes.items():
        held = set(r.anchors)
        if frames is not None:
            held.update(frames.get(g, ()))
        for a in held:
            first_read[a] = min(first_read.get(a, trigger[g]), trigger[g])
    return trigger, first_read

def _recompute_steps(sg: StepGraph, ops: list[int], steps, resident: set[int],
                     retain: set[int], frames: bool = False):
    """Steps of one group's rebuild: its ops in order (those whose nodes are not all on the
    device), each node it makes freed after the last op of the rebuild that reads it, as the
    runtime drops it (``_Group._replay``); the nodes in ``retain`` (the members') stay until
    their own unpack (note 4). An op on the device whose part a later op of the rebuild reads
    is replayed for it (the runtime replays what is not an anchor); only the part is counted
    again. ``frames``: the rebuild is checkpoint re-running the module's own code, whose
    Python variables hold a transient as long as they did in the forward (to the op before
    its python death), or to the rebuild's end where that lies beyond it."""
    def nodes_of(i: int) -> list[int]:
        return [sg.op_node[i]] + [sg.sum_node[v] for v in sg.parts.get(i, ())]

    computed = [i for i in ops if any(nd not in resident for nd in nodes_of(i))]
    last_read: dict[int, int] = {}
    for k, i in enumerate(computed):
        last_read[i] = k
        for c in sg.reads[i]:
            if c in last_read:
                last_read[c] = k
    if frames:
        values = sg.profile.values
        for k, i in enumerate(computed):
            death = max((values[v].python_death or i + 1 for v in sg.profile.ops[i].new_values),
                        default=i + 1)
            # The last op of the rebuild that runs before the python death (the rebuild's
            # last op where it stops first: its variables go with it).
            held = bisect.bisect_left(computed, death) - 1
            last_read[i] = max(last_read[i], held)
    gone_after: dict[int, list[int]] = {}
    for i, k in last_read.items():
        gone_after.setdefault(k, []).append(i)
    made: dict[int, list[int]] = {}  # op -> the nodes this rebuild made for it
    for k, i in enumerate(computed):
        for nd in nodes_of(i):
            if nd not in resident:
                steps.append(("compute", nd))
                resident.add(nd)
                made.setdefault(i, []).append(nd)
        for j in gone_after.get(k, ()):
            for nd in made.pop(j, ()):
                if nd not in retain:
                    steps.append(("free", nd))
                    resident.discard(nd)

def rebuild_groups(decisions, recipes, grouped: bool = True,
                   together: Optional[dict[int, int]] = None
                   ) -> tuple[dict[int, int], dict[int, Recipe]]:
    """Groups of rebuilt values whose recipes share an op (note 4), by union-find on the
    ops: value -> group id, and group id -> the union recipe. ``grouped=False``: each value
    alone (less held at once, shared ops replayed once per value). ``together``: value ->
    a key; values with the same key are one group whether or not their recipes share an op
    (``torch.utils.checkpoint`` rebuilds a module's saved tensors at once: under autocast a
    layer's last weight cast shares no op with the layer's activations)."""
    if not grouped:
        alone = [v for v, d in decisions.items() if d == RECOMPUTE and v in recipes]
        return {v: v for v in alone}, {v: recipes[v] for v in alone}
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        root = x
        while parent[root] != root:
            root = parent[root]
        while parent[x] != root:
            parent[x], x = root, parent[x]
        return root

    owner: dict[int, int] = {}  # op -> a value whose recipe replays it
    members = [v for v, d in decisions.items() if d == RECOMPUTE and v in recipes]
    for v in members:
        parent[v] = v
        for i in recipes[v].ops:
            other = owner.setdefault(i, v)
            if other != v:
                a, b = find(v), find(other)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    first_with: dict[int, int] = {}  # key -> a member with that key
    for v in members:
        if together is not None and v in together:
            other = first_with.setdefault(together[v], v)
            a, b = find(v), find(other)
            if a != b:
                parent[max(a, b)] = min(a, b)
    groups = {v: find(v) for v in members}
    ops: dict[int, set[int]] = {}
    anchors: dict[int, set[int]] = {}
    for v, g in groups.items():
        ops.setdefault(g, set()).update(recipes[v].ops)
        anchors.setdefault(g, set()).update(recipes[v].anchors)
    return groups, {g: Recipe(ops=sorted(ops[g]), anchors=sorted(anchors[g])) for g in ops}

def positions_of(sg, plan: EagerPlan) -> list[int]:
    """For each schedule step, the op position it belongs to (the last op computed for the
    first time at or before it)."""
    out = [0] * len(plan.steps)
    seen: set[int] = set()
    position = 0
    for i, (op, node) in enumerate(plan.steps):
        if op == "compute" and node not in seen:
            seen.add(node)
            if sg.kinds[node] == "op":
                position = sg.node_op[node]
        out[i] = position
    return out

def _evaluate(sg, decisions, recipes, prefetch, bandwidth, budget_bytes, strategy, store_all,
              anchors=frozenset()) -> EagerPlan:
    """The plan of these decisions, its rebuilds grouped (note 4) or one value at a time,
    whichever is better: within the budget the faster, else the lower peak."""
    together = _evaluate_as(sg, decisions, recipes, prefetch, bandwidth, budget_bytes,
                            strategy, store_all, True)
    if not together.groups or len(together.group_recipes) == len(together.groups):
        return together  # nothing shared: the same plan either way
    alone = _evaluate_as(sg, decisions, recipes, prefetch, bandwidth, budget_bytes,
                         strategy + "/alone", store_all, False)
    fits = [p for p in (together, alone) if p.predicted_peak <= budget_bytes]
    if fits:
        return min(fits, key=lambda p: p.cost)
    return min((together, alone), key=lambda p: (p.predicted_peak, p.cost))

def _evaluate_as(sg, decisions, recipes, prefetch, bandwidth, budget_bytes, strategy,
                 store_all, grouped: bool,
                 frames: Optional[dict[int, tuple[int, ...]]] = None,
                 together: Optional[dict[int, int]] = None) -> EagerPlan:
    used = set()
    for vid, r in recipes.items():
        if decisions.get(vid) == RECOMPUTE:
            used.update(r.anchors)
    groups, group_recipes = rebuild_groups(decisions, recipes, grouped, together)
    steps = eager_schedule(sg, decisions, prefetch, groups, group_recipes, frames)
    report = with_workspace(sg, steps,
                            _native.simulate(sg.graph._native, steps, float(bandwidth or 1.0)))
    base = report["base_time"]
    overhead = (report["total_time"] - base) / base if base > 0 else 0.0
    moved = any(d != KEEP for d in decisions.values())
    hooks = (sg.profile.forward_ops * dispatch_seconds() / (base * TIME_UNIT_S)
             if moved and base > 0 else 0.0)
    return EagerPlan(
        decisions=dict(decisions), recipes=recipes, anchors=used, prefetch_at=prefetch,
        predicted_peak=int(report["peak_bytes"]), store_all_peak=store_all,
        budget_bytes=budget_bytes, static_bytes=sg.static_bytes, overhead=overhead,
        strategy=strategy, report=report, steps=steps, groups=groups,
        group_recipes=group_recipes, hook_overhead=hooks,
    )

def with_workspace(sg: StepGraph, steps: list[tuple[str, int]], report: dict) -> dict:
    """The simulator's report with each op's workspace (the profile's note 4) on top of the
    bytes live as its node computes, in the forward, the backward and every replay: the
    peak and its step move where a workspace makes a higher one. The simulator's graph has
    no workspace of its own; the bytes after a compute step are the timeline's last point
    at or before it (points are written where the bytes change)."""
    if not sg.workspace:
        return report
    timeline = report["timeline"]
    at = [point[0] for point in timeline]
    peak, peak_step = report["peak_bytes"], report["peak_step"]
    for index, (how, node) in enumerate(steps):
        extra = sg.workspace.get(node) if how == "compute" else None
        if not extra:
            continue
        k = bisect.bisect_right(at, index) - 1
        live = timeline[k][2] if k >= 0 else sg.static_bytes
        if live + extra > peak:
            peak, peak_step = live + extra, index
    report["peak_bytes"], report["peak_step"] = peak, peak_step
    return report

@functools.cache
def checkpoint_call_seconds() -> float:
    """Seconds one non-reentrant ``torch.utils.checkpoint`` call adds to a training step
    beyond the ops it replays (its frame, hooks and replay set-up in the forward and the
    backward), measured once per process around a single small op: about 0.2 ms on a
    2-core CPU, which per module is what makes checkpointing every norm apart cost more
    than checkpointing the layer around them."""
    x = torch.zeros(4, 4, requires_grad=True)

    def one(t):
        return t * 1.5

    def per_step(checkpointed: bool, n: int = 100) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            y = (torch.utils.checkpoint.checkpoint(one, x, use_reentrant=False)
                 if checkpointed else one(x))
            y.sum().backward()
        return (time.perf_counter() - t0) / n

    plain, hooked = [], []
    for _ in range(5):  # alternating, as in dispatch_seconds
        plain.append(per_step(False))
        hooked.append(per_step(True))
    # On the grid of the profile's times, so that two processes charge the same.
    return quantized(max(0.0, min(hooked) - min(plain)))

@functools.cache
def dispatch_seconds() -> float:
    """Seconds a planned step under the dispatch mode and saved-tensor hooks adds per
    forward op, measured once per process: a pass-through mode around small ops, times six
    for what the run mode checks and records and the hooks' work in the backward. Six is
    read off the bench: Llama 4x64 on CPU ran 1.67x eager with 326 forward ops where the
    plan predicted 1.015x (about 70 us an op, a pass-through mode costing 11), and an H200
    host lost about 40 ms a step to it over some 1,100."""
    class _PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x = torch.zeros(1)

    def per_op(n: int = 300) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            torch.add(x, x)
        return (time.perf_counter() - t0) / n

    # Alternating rounds, the least of each: a burst of other work on a shared machine
    # slows some rounds of both kinds, not all rounds of one.
    plain, hooked = [], []
    for _ in range(7):
        plain.append(per_op())
        with _PassThrough():
            hooked.append(per_op())
    return quantized(max(0.0, 6.0 * (min(hooked) - min(plain))))
