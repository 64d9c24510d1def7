"""Planning an eager step: the profiled ops as remat's graph, the planner's decisions as
keep / offload / recompute per saved value, and the schedule eager autograd will really run
under them, judged by remat's simulator.

The graph has one node per aten op of the step (forward and backward, in the order eager
ran them) and a final ``end:step`` node. A node's output is the storages its op made; its
inputs are the values its op read, plus two *lifetime reads* per value: the op before its
python death and the op before its expiry, so that with nothing changed the simulator holds
every storage exactly as long as the unplanned step did. The order is fixed (random ops draw
from one generator stream in that order) and backward nodes are pinned (autograd runs each
once).

Notes:

1. The planner may propose what eager cannot do (recompute during the forward, free a value
   the model's code still holds). Its plan is only a proposal: :func:`eager_schedule`
   writes down what the runtime will do under the decisions taken from it, and the
   simulator's peak of *that* schedule is the predicted peak. Planning retries at lower
   planner budgets until that peak fits.
2. A recompute rebuilds a value from *anchors* (values the runtime holds from the forward
   until their last use in a recompute) and static tensors, replaying every op in between
   (its recipe). Anchors are the planner's ``from`` tensors that it keeps.
3. Offload is only planned where a host copy runs beside compute (CUDA), or where the
   caller names a bandwidth; on CPU the host is the device's own memory.
4. Rebuilt values whose recipes share an op form a *group*, rebuilt at once at the first
   unpack of any member, which replays the union of their recipes (each op once) and keeps
   every member it made until its own unpack, as ``torch.utils.checkpoint`` keeps a
   segment's recomputed tensors. Rebuilding them one by one would replay a shared prefix
   once per member (the backward unpacks a segment from its last value to its first).
   Anchors (kept values) cut recipes, and so bound how much one group holds.
5. A plan that rebuilds every saved value inside some modules from their inputs, and keeps
   everything else, is what ``torch.utils.checkpoint`` around those modules does, with
   the same groups: such plans run that way (no dispatch mode, whose per-op cost in Python
   is charged to every other plan that rebuilds or offloads). They are judged as checkpoint
   runs them: a module's frame holds its inputs until autograd has released the last
   tensor the module saved (remat's own groups let go of their anchors at the rebuild),
   and each checkpointed call costs its Python set-up, so that checkpointing every norm
   apart is charged for the calls it adds.
6. A forward op's storages that autograd never unpacks have nodes of their own beside the
   op's (part nodes), and so do a backward op's storages after its first: one node per op
   would hold all its outputs as long as the longest lived (a layer norm's output, read
   by the next op only, as long as its saved mean and rstd).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import re
import time
from typing import Optional

import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from .._plan import Graph, as_graph, plan as rust_plan
from .. import _native
from ..errors import BudgetError
from ._eager_profile import OpRecord, Profile, TensorRef

TIME_UNIT_S = 1e-6
KEEP, RECOMPUTE, OFFLOAD = "keep", "recompute", "offload"


@dataclasses.dataclass
class Recipe:
    """How to rebuild one saved value: replay ``ops`` (ascending) on rebuilt arguments."""

    ops: list[int]
    anchors: list[int]  # values read as they are held (never rebuilt)


@dataclasses.dataclass
class EagerPlan:
    """Decisions for one profiled step, with the simulator's report of the schedule the
    runtime will run."""

    decisions: dict[int, str]  # saved value -> keep / recompute / offload
    recipes: dict[int, Recipe]
    anchors: set[int]
    prefetch_at: dict[int, int]  # offloaded value -> op position of its prefetch
    predicted_peak: int
    store_all_peak: int
    budget_bytes: int
    static_bytes: int
    overhead: float  # predicted (recompute + stalls) / step time
    strategy: str
    report: dict
    steps: list
    unplanned: Optional[dict] = None  # the simulator's report of the unplanned eager step
    # Rebuild groups (note 4): rebuilt value -> group; group -> the union of its members'
    # recipes, replayed once at the first unpack of any member.
    groups: dict[int, int] = dataclasses.field(default_factory=dict)
    group_recipes: dict[int, Recipe] = dataclasses.field(default_factory=dict)
    # Run by ``torch.utils.checkpoint`` around these modules (qualified names) instead of
    # the dispatch mode (note 5): the plan of a module-segment family without kept values.
    checkpoint_modules: tuple[str, ...] = ()
    # Predicted cost of running the plan under the dispatch mode, as a fraction of the step
    # (zero for plans that keep everything or run by ``checkpoint_modules``).
    hook_overhead: float = 0.0

    @property
    def cost(self) -> float:
        """Predicted overhead with the runtime's own cost: what plans are chosen by."""
        return self.overhead + self.hook_overhead

    @property
    def keeps_everything(self) -> bool:
        return all(d == KEEP for d in self.decisions.values())

    def count(self, kind: str) -> int:
        return sum(1 for d in self.decisions.values() if d == kind)


class StepGraph:
    """The profiled step as remat's graph (see the module notes).

    Node ``op_node[i]`` is op ``i``; after an op at which some values' lifetime reads fall,
    a zero-cost *hold* node reads them (kept apart from the op, so that replaying the op
    never needs them), and ``end`` reads what outlives the step. Two kinds of backward
    values have zero-cost nodes of their own, so that each lives as long as it does: the
    gradients autograd sums between nodes (*sum* nodes, just before the op that reads them
    first), and a backward op's storages after its first (*part* nodes, just after it: a
    convolution's or a layer norm's input gradient goes with the next node while its weight
    gradient lives to the end of the step, and one node would hold both as long as the
    longer).
    """

    def __init__(self, profile: Profile, static_bytes: int):
        self.profile = profile
        self.static_bytes = static_bytes
        ops = profile.ops
        self.n = len(ops)
        values = profile.values
        # Gradients autograd summed between nodes (first seen as an op's input, made by no
        # op): each its own zero-cost node just before that op, alive from the sum on, so
        # that the summands are still there when it is made and it lives as long as it
        # does, not as long as the op's own outputs.
        self.sums: dict[int, list[int]] = {}  # op -> the sums first read there
        self.parts: dict[int, list[int]] = {}  # backward op -> its storages after the first
        owned: set[int] = set()  # backward ops whose node holds a storage already
        for value in values:
            if value.nbytes == 0 or value.op < profile.forward_ops:
                continue
            if value.id not in ops[value.op].new_values:
                self.sums.setdefault(value.op, []).append(value.id)
            elif value.op in owned:
                self.parts.setdefault(value.op, []).append(value.id)
            else:
                owned.add(value.op)
        # A forward op's storages that autograd never unpacks (no decision is taken on them)
        # get part nodes too, where the op keeps another in its own node: a layer norm's
        # output that only the next op reads leaves then, while its saved mean and rstd stay
        # to the backward. (Not those autograd keeps: a rebuild that replays the op for one
        # of them while another is held makes a second copy of that one, which one node per
        # storage cannot count.)
        forward: dict[int, list[int]] = {}
        for value in values:
            if value.nbytes > 0 and value.op < profile.forward_ops:
                forward.setdefault(value.op, []).append(value.id)
        for op, vids in forward.items():
            decided = [v for v in vids if _decided(values[v])]
            if decided and len(decided) < len(vids):
                self.parts[op] = [v for v in vids if not _decided(values[v])]
        summed = {v for vs in self.sums.values() for v in vs}
        summed.update(v for vs in self.parts.values() for v in vs)

        def key(vid: int):
            return ("sum", vid) if vid in summed else ("op", values[vid].op)

        reads: list[set[int]] = [set() for _ in range(self.n)]
        read_keys: list[set] = [set() for _ in range(self.n)]
        for op in ops:
            for ref in _refs(op.leaves):
                if ref.value >= 0 and values[ref.value].nbytes > 0:
                    c = values[ref.value].op
                    if ref.value in summed:
                        read_keys[op.index].add(key(ref.value))
                        if c < min(op.index, profile.forward_ops):
                            reads[op.index].add(c)  # a forward part: rebuilt with its op
                    elif c < op.index:
                        reads[op.index].add(c)
                        read_keys[op.index].add(key(ref.value))
        self.reads = reads  # op -> the ops whose values it reads
        self.seconds = steady_seconds(profile)
        holds: list[set] = [set() for _ in range(self.n + 1)]
        for value in values:
            if value.nbytes == 0:
                continue
            for position in (value.python_death, self.expiry(value.id)):
                if position is not None and position - 1 > value.op:
                    holds[min(position - 1, self.n)].add(key(value.id))
        self.op_node: list[int] = []
        self.hold_node: dict[int, int] = {}
        self.sum_node: dict[int, int] = {}  # sum or part value -> its node
        self.node_value: dict[int, int] = {}  # sum or part node -> its value
        names, inputs, kinds = [], [], []
        for i in range(self.n):
            for v in self.sums.get(i, ()):
                self.node_value[len(names)] = v
                self.sum_node[v] = len(names)
                names.append(i)
                kinds.append("sum")
                inputs.append(set())
            self.op_node.append(len(names))
            names.append(i)
            kinds.append("op")
            inputs.append(read_keys[i])
            for v in self.parts.get(i, ()):
                self.node_value[len(names)] = v
                self.sum_node[v] = len(names)
                names.append(i)
                kinds.append("part")
                inputs.append({("op", i)})
            if holds[i]:
                self.hold_node[i] = len(names)
                names.append(i)
                kinds.append("hold")
                inputs.append(holds[i])
        self.end = len(names)
        names.append(self.n)
        kinds.append("end")
        inputs.append(holds[self.n])
        self.node_op = names
        self.kinds = kinds

        def node(k) -> int:
            return self.sum_node[k[1]] if k[0] == "sum" else self.op_node[k[1]]

        self.inputs = [sorted({node(k) for k in s}) for s in inputs]
        self.bytes = [0] * len(names)
        for value in values:
            self.bytes[self.sum_node.get(value.id, self.op_node[value.op])] += value.nbytes
        self._graph: Optional[Graph] = None

    def node_of(self, vid: int) -> int:
        """The node whose output holds value ``vid``."""
        own = self.sum_node.get(vid)
        return own if own is not None else self.op_node[self.profile.values[vid].op]

    def expiry(self, vid: int) -> int:
        """The position at which value ``vid`` leaves the device at the latest: when the
        node that read it last lets go of its saved tensors. (A tensor rebuilt under
        ``torch.utils.checkpoint`` may go a few ops sooner, where the node's own code drops
        it before its end: by a few hundred bytes in the models measured, so the
        prediction stays on the safe side.)"""
        return self.profile.values[vid].expiry

    @property
    def num_nodes(self) -> int:
        return len(self.node_op)

    def node_name(self, node: int) -> str:
        kind = self.kinds[node]
        if kind == "end":
            return "end:step"
        op = self.profile.ops[self.node_op[node]]
        label = f"{op.index}:{op.name.removeprefix('aten::')}@{op.where}"
        if kind in ("sum", "part"):
            return f"{kind}{self.node_value[node]}:" + label
        return label if kind == "op" else f"{kind}:" + label

    def to_dict(self) -> dict:
        ops = self.profile.ops
        nodes = []
        for node in range(self.num_nodes):
            kind = self.kinds[node]
            if kind == "op":
                op = ops[self.node_op[node]]
                phase, seconds = op.phase, self.seconds[op.index]
                pinned = op.phase == "backward" or not op.replayable
            elif kind == "part":
                # Made by its op at no cost of its own (and again when a rebuild replays it).
                op = ops[self.node_op[node]]
                phase, seconds = op.phase, 0.0
                pinned = op.phase == "backward" or not op.replayable
            else:
                i = self.node_op[node]
                phase = ops[i].phase if i < self.n else "backward"
                seconds, pinned = 0.0, True
            entry = {
                "name": self.node_name(node),
                "phase": phase,
                "compute_time": round(seconds / TIME_UNIT_S, 3),
                "output_bytes": self.bytes[node],
                "inputs": self.inputs[node],
            }
            if pinned:
                entry["pinned"] = True
            nodes.append(entry)
        return {
            "format": "remat-graph",
            "version": 1,
            "name": "eager-step",
            "time_unit_s": TIME_UNIT_S,
            "static_bytes": self.static_bytes,
            "fixed_order": True,
            "nodes": nodes,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @property
    def graph(self) -> Graph:
        if self._graph is None:
            self._graph = as_graph(self.to_json())
        return self._graph


_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")


def steady_seconds(profile: Profile) -> list[float]:
    """Each op's time as the median over the step's ops of its kind: the same aten op on
    the same shapes in the same place of a repeated module (``layers.3.mlp`` and
    ``layers.0.mlp`` alike) or the same autograd node. The profiled step is often the
    model's first, where an op's first call pays for its lazy set-up (1 ms for a small
    BERT's first GELU, 0.4 for the later ones): one layer's outlier would otherwise count
    as that layer's cost to rebuild."""
    kinds: dict[tuple, list[int]] = {}
    for op in profile.ops:
        shapes = tuple(ref.size for ref in _refs(op.leaves))
        key = (op.name, _LAYER_INDEX.sub(".#", op.where), op.phase, shapes)
        kinds.setdefault(key, []).append(op.index)
    seconds = [op.seconds for op in profile.ops]
    for members in kinds.values():
        if len(members) > 2:
            times = sorted(profile.ops[i].seconds for i in members)
            typical = times[len(times) // 2]
            for i in members:
                seconds[i] = typical
    return seconds


def _decided(value) -> bool:
    """Whether keep / offload / recompute is decided for ``value``: autograd unpacks it."""
    return value.saved and value.first_unpack is not None


def _refs(leaves) -> list[TensorRef]:
    return [x for x in leaves if isinstance(x, TensorRef)]


# ---- which values can be rebuilt ---------------------------------------------------------


def mark_recomputable(profile: Profile) -> None:
    """Sets ``Value.recomputable`` / ``why_not``: a saved value can be rebuilt only when
    every op of its history is a forward aten op that may run again, its packs all saw one
    version, and no static it reads is written later in the forward."""
    forward = profile.forward_ops
    written_statics: dict[int, int] = {}  # static -> last forward op writing it
    for op in profile.ops[:forward]:
        for p in op.written:
            ref = op.leaves[p]
            if isinstance(ref, TensorRef) and ref.value < 0 and p not in op.stats:
                written_statics[ref.static] = op.index
    versions: dict[int, set[int]] = {}
    for pack in profile.packs:
        if pack.ref.value >= 0:
            versions.setdefault(pack.ref.value, set()).add(pack.ref.version)
    for value in profile.values:
        reason = ""
        history = [value.op, *value.writers]
        if value.op >= forward:
            reason = "made in the backward"
        elif any(w >= forward for w in value.writers):
            reason = "written in place during the backward"
        elif len(versions.get(value.id, ())) > 1:
            reason = "saved at several versions"
        elif value.id in versions and min(versions[value.id]) < 1 + len(value.writers):
            reason = "written in place after autograd saved it"
        else:
            for i in history:
                op = profile.ops[i]
                if not op.replayable:
                    reason = f"made by {op.name}, which is not replayed"
                    break
                if op.random and _has_generator(op):
                    reason = f"{op.name} draws from a generator given as an argument"
                    break
                for ref in _refs(op.leaves):
                    if ref.value < 0 and written_statics.get(ref.static, -1) > i:
                        reason = (f"{op.name} reads `{profile.statics[ref.static]}`, which is "
                                  "written in place later in the forward")
                        break
                if reason:
                    break
        value.recomputable = not reason
        value.why_not = reason


def _has_generator(op: OpRecord) -> bool:
    return any(type(x).__name__ == "Generator" for x in op.leaves)


def recipe(profile: Profile, vid: int, anchors: set[int]) -> Optional[Recipe]:
    """The ops that rebuild value ``vid`` (at the version its packs saw) from ``anchors``
    and statics, or None when some value on the way cannot be rebuilt. Explicit stack."""
    values = profile.values
    version = _saved_version(profile, vid)
    # The rebuild runs at the value's first unpack: a static freed by then (FSDP2's
    # resharded parameters) cannot be read, so no path through an op reading it; an anchor
    # freed by then is rebuilt instead of read.
    absent = values[vid].absent_statics
    absent_anchors = values[vid].absent_values
    need: set[int] = set()
    used_anchors: set[int] = set()
    stack = [(vid, version)]
    seen = set()
    while stack:
        v, k = stack.pop()
        if (v, k) in seen:
            continue
        seen.add((v, k))
        value = values[v]
        if not value.recomputable:
            return None
        history = [value.op, *value.writers][:k]
        for i in history:
            if i in need:
                continue
            need.add(i)
            for ref in _refs(profile.ops[i].leaves):
                if ref.value < 0:
                    if ref.static in absent:
                        return None
                    continue
                u = values[ref.value]
                if ref.value == v:
                    continue  # the value being rebuilt, at an earlier version
                final = 1 + len(u.writers)
                if (ref.value in anchors and ref.version == final
                        and ref.value not in absent_anchors):
                    used_anchors.add(ref.value)
                else:
                    stack.append((ref.value, ref.version))
    return Recipe(ops=sorted(need), anchors=sorted(used_anchors))


def _saved_version(profile: Profile, vid: int) -> int:
    for pack in profile.packs:
        if pack.ref.value == vid:
            return pack.ref.version
    return 1 + len(profile.values[vid].writers)


# ---- the schedule the runtime runs ---------------------------------------------------------


def eager_schedule(sg: StepGraph, decisions: dict[int, str], prefetch_at: dict[int, int],
                   groups: dict[int, int], group_recipes: dict[int, Recipe],
                   frames: Optional[dict[int, tuple[int, ...]]] = None
                   ) -> list[tuple[str, int]]:
    """The steps eager autograd takes under ``decisions`` (see the module notes), in the
    simulator's language. A value's bytes belong to its op's node; positions are ops.

    ``frames``: the groups run as ``torch.utils.checkpoint`` runs a module (note 5), each
    with the values among its module's arguments: its frame holds them (the group's anchors
    and whatever else the call was given, an attention mask, positions) until autograd has
    released the last tensor the module saved, not only until the rebuild as remat's own
    runtime does."""
    profile = sg.profile
    values = profile.values
    n = sg.n
    members: dict[int, list[int]] = {}
    for v, g in groups.items():
        members.setdefault(g, []).append(v)
    # A group is rebuilt at the first unpack of any member; its anchors are read then.
    trigger = {g: min(values[v].first_unpack for v in vs) for g, vs in members.items()}
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
        if not moved or KEEP in kinds or any(v in last_anchor_use for v in vids):
            continue
        if len(moved) > 1:
            continue
        death = max(values[v].python_death for v in vids)
        comeback = min(values[v].first_unpack for v in vids if decisions.get(v) in moved)
        if death >= comeback:
            continue
        early[nd] = death
        if OFFLOAD in moved:
            at = min(prefetch_at.get(v, comeback) for v in vids if v in prefetch_at)
            back_at.setdefault(max(at, death), []).append(("swap_in", nd))
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
        for how, x in sorted(back_at.get(p, ())):
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


# ---- planning -----------------------------------------------------------------------------


def plan_step(profile: Profile, static_bytes: int, budget, *, bandwidth: Optional[float],
              time_limit: Optional[float], strategy: Optional[str] = None,
              checkpointable: bool = True) -> EagerPlan:
    """Plans the profiled step under ``budget`` (bytes of the step's peak, or a float
    fraction of its activation bytes: the store-all peak above the static bytes and the
    parameters' gradients).

    ``bandwidth``: host copies per second for offload, None for recompute only.
    ``strategy``: a strategy of the Rust planner, the only one then; ``"checkpoint"``: the
    best plan run by ``torch.utils.checkpoint`` around modules (note 5), or none.
    ``checkpointable``: whether such plans may be run that way (not where re-running a
    module's forward has effects beyond its outputs: a key/value cache it appends to).
    """
    mark_recomputable(profile)
    sg = StepGraph(profile, static_bytes)
    graph = sg.graph
    store_all = graph.store_all_peak
    # Gradients that outlive the step (the parameters' .grad) are no activations: a fraction
    # budget leaves them whole.
    kept_grads = sum(v.nbytes for v in profile.values
                     if v.op >= profile.forward_ops and v.expiry == len(profile.ops))
    budget_bytes = _budget_bytes(budget, store_all, static_bytes + kept_grads)
    keep_all = _evaluate(sg, {}, {}, {}, bandwidth, budget_bytes, "keep", store_all)
    keep_all.unplanned = keep_all.report
    if keep_all.predicted_peak <= budget_bytes:
        return keep_all
    keep_all.decisions = {v.id: KEEP for v in profile.values
                          if v.saved and v.first_unpack is not None}
    if strategy == "checkpoint":
        return _checkpoint_only(sg, bandwidth, budget_bytes, store_all, keep_all)
    best: Optional[EagerPlan] = None
    tried: list[EagerPlan] = [keep_all]
    link = bandwidth if bandwidth else 1.0
    floor = graph.memory_floor
    # Proposals at decreasing planner budgets: the eager schedule holds more than the
    # planner's where the planner uses what eager cannot (note 1), so ask for less by the
    # excess; where the planner finds nothing, bisect toward the last budget it met.
    high, target = budget_bytes, budget_bytes
    low = floor
    step = max(1, (budget_bytes - static_bytes) // 100)
    for _ in range(8):
        if target < floor:
            break
        try:
            proposal = rust_plan(graph, int(target), strategy=strategy, bandwidth=link,
                                 time_limit=time_limit)
        except BudgetError:
            low = target
            target = (low + high) // 2
            if high - low <= step:
                break
            continue
        candidate = _from_proposal(sg, proposal, bandwidth, budget_bytes, store_all)
        tried.append(candidate)
        if candidate.predicted_peak <= budget_bytes:
            best = candidate
            break
        high = target
        target = max(low, min(target - (candidate.predicted_peak - budget_bytes),
                              target - step))
    # A strategy the caller names is the planner's only (no module segments beside it).
    segmented = [] if strategy else _module_segments(sg, bandwidth, budget_bytes, store_all)
    if not checkpointable:
        segmented = [p for p in segmented if not p.checkpoint_modules]
    for candidate in segmented:
        tried.append(candidate)
        if candidate.predicted_peak <= budget_bytes and (
                best is None or candidate.cost < best.cost):
            best = candidate
    lowest = None
    if best is None:
        lowest = _recompute_everything(sg, bandwidth, budget_bytes, store_all)
        if lowest.predicted_peak <= budget_bytes:
            best = lowest
    if best is None:
        # (Checkpointed-module plans are judged on graphs of their own: not a start.)
        start = min([p for p in tried if not p.checkpoint_modules] + [lowest],
                    key=lambda p: p.predicted_peak)
        lowest = _descend(sg, start, bandwidth, budget_bytes, store_all)
        if lowest.predicted_peak <= budget_bytes:
            best = lowest
    if best is not None:
        best.unplanned = keep_all.report
    if best is None:
        raise BudgetError(
            f"memory_budget {_native.human_bytes(budget_bytes)}: the least peak an eager "
            f"plan of this step reaches is {_native.human_bytes(lowest.predicted_peak)} "
            f"(by {lowest.strategy}; the unplanned step "
            f"peaks at {_native.human_bytes(store_all)}, its static bytes are "
            f"{_native.human_bytes(static_bytes)})",
            budget_bytes=budget_bytes, best_peak=lowest.predicted_peak,
            floor_bytes=lowest.predicted_peak,
        )
    return best


def _budget_bytes(budget, store_all: int, static_bytes: int) -> int:
    """Bytes of a budget; a fraction is of the activation bytes: the unplanned peak above
    ``static_bytes`` (static tensors and the gradients the step leaves)."""
    if isinstance(budget, bool):
        raise BudgetError(f"memory_budget {budget!r}: give bytes, a fraction or text")
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise BudgetError(
                f"memory_budget {budget!r}: a float is a fraction of the step's activation "
                "bytes and must be in (0, 1]; give bytes as an int or text (\"8GiB\")")
        activations = store_all - static_bytes
        return static_bytes + int(activations * budget)
    if isinstance(budget, int):
        if budget <= 0:
            raise BudgetError(f"memory_budget {budget}: bytes must be positive")
        return budget
    if isinstance(budget, str):
        text = budget.strip()
        try:
            fraction = float(text)
        except ValueError:
            fraction = None
        if fraction is not None and 0.0 < fraction <= 1.0 and "." in text:
            return _budget_bytes(fraction, store_all, static_bytes)
        size = _native.parse_size(text, "memory_budget")
        if size <= 0:
            raise BudgetError(f"memory_budget {text}: bytes must be positive")
        return size
    raise BudgetError(
        f"memory_budget: give bytes (int), a fraction (float) or text, not {type(budget).__name__}")


def _from_proposal(sg: StepGraph, proposal, bandwidth, budget_bytes, store_all) -> EagerPlan:
    profile = sg.profile
    decisions_by_node = proposal.decisions
    decisions: dict[int, str] = {}
    anchors: set[int] = set()
    prefetch: dict[int, int] = {}
    by_op: dict[int, list[int]] = {}
    for value in profile.values:
        by_op.setdefault(value.op, []).append(value.id)
    for value in profile.values:
        if not value.saved or value.first_unpack is None:
            continue
        d = decisions_by_node[sg.node_of(value.id)]
        kind = d.get("kind")
        if kind == "recompute" and value.recomputable:
            decisions[value.id] = RECOMPUTE
            for src in d.get("from", ()):
                # A source the planner keeps is held from the forward (an anchor); one it
                # recomputes itself is rebuilt on the way (or found rebuilt already).
                if (sg.kinds[src] == "op" and sg.node_op[src] < profile.forward_ops
                        and decisions_by_node[src].get("kind") == "keep"):
                    anchors.update(by_op.get(sg.node_op[src], ()))
        elif kind == "swap" and bandwidth and all(w < profile.forward_ops
                                                  for w in value.writers):
            decisions[value.id] = OFFLOAD
            at = sg.node_op[int(d.get("prefetch_at", sg.op_node[value.first_unpack]))]
            prefetch[value.id] = min(at, value.first_unpack)
        else:
            decisions[value.id] = KEEP
    # Anchors are held, never rebuilt; a value both anchor and recompute stays an anchor.
    for a in list(anchors):
        if decisions.get(a) == RECOMPUTE:
            decisions[a] = KEEP
    # Saved values that stay are held by autograd anyway: rebuilds start from them too.
    anchors.update(v for v, d in decisions.items() if d == KEEP)
    recipes = _recipes(profile, decisions, anchors)
    return _evaluate(sg, decisions, recipes, prefetch, bandwidth, budget_bytes,
                     proposal.strategy, store_all, anchors)


def _recipes(profile, decisions, anchors) -> dict[int, Recipe]:
    recipes = {}
    for vid, kind in list(decisions.items()):
        if kind != RECOMPUTE:
            continue
        r = recipe(profile, vid, anchors)
        if r is None:
            decisions[vid] = KEEP
        else:
            recipes[vid] = r
    return recipes


def rebuild_groups(decisions, recipes, grouped: bool = True
                   ) -> tuple[dict[int, int], dict[int, Recipe]]:
    """Groups of rebuilt values whose recipes share an op (note 4), by union-find on the
    ops: value -> group id, and group id -> the union recipe. ``grouped=False``: each value
    alone (less held at once, shared ops replayed once per value)."""
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
    groups = {v: find(v) for v in members}
    ops: dict[int, set[int]] = {}
    anchors: dict[int, set[int]] = {}
    for v, g in groups.items():
        ops.setdefault(g, set()).update(recipes[v].ops)
        anchors.setdefault(g, set()).update(recipes[v].anchors)
    return groups, {g: Recipe(ops=sorted(ops[g]), anchors=sorted(anchors[g])) for g in ops}


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
        module_of = _rebuilt_modules(profile, segments, depth, plan)
        if module_of:
            plans.append(_as_checkpointed(sg, plan, module_of, bandwidth, budget_bytes,
                                          store_all, depth))
        if plan.predicted_peak > budget_bytes:
            continue
        plans.append(_relax(sg, segments, plan, bandwidth, budget_bytes, store_all, depth))
    return plans


def _as_checkpointed(sg, plan: EagerPlan, module_of: dict[int, str], bandwidth,
                     budget_bytes, store_all, depth) -> EagerPlan:
    """``plan`` run by ``torch.utils.checkpoint`` around the module of each of its groups
    (note 5): its frames hold the modules' arguments longer than remat's groups hold their
    anchors, and each call costs what the checkpoint machinery costs in Python, in place of
    the dispatch mode's per-op cost."""
    frames = {g: sg.profile.module_inputs.get(name, ()) for g, name in module_of.items()}
    run = _evaluate_as(sg, plan.decisions, plan.recipes, {}, bandwidth, budget_bytes,
                       f"checkpoint:depth{depth}", store_all, True, frames=frames)
    base = run.report["base_time"] * TIME_UNIT_S
    calls = len(module_of) * checkpoint_call_seconds() / base if base > 0 else 0.0
    modules = tuple(module_of[g] for g in sorted(
        module_of, key=lambda g: plan.group_recipes[g].ops[0]))
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
                     ) -> dict[int, str]:
    """The modules to run under ``torch.utils.checkpoint`` for a segmented ``plan``, by the
    group each rebuilds: those whose segment the plan rebuilds, each as one group
    (checkpoint rebuilds a module at once); a segment that rebuilds nothing runs as it is
    (autograd keeps what it saves, as the plan does). Empty when the segments are no module
    calls or a segment's rebuilds form several groups."""
    names = _checkpointable(profile, segments, depth)
    if not names:
        return {}
    segment_of = {i: k for k, ops in enumerate(segments) for i in ops}
    module_of: dict[int, str] = {}
    for g, recipe in plan.group_recipes.items():
        k = segment_of.get(recipe.ops[0]) if recipe.ops else None
        if k is None or names[k] in module_of.values():
            return {}
        module_of[g] = names[k]
    return module_of


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
                 frames: Optional[dict[int, tuple[int, ...]]] = None) -> EagerPlan:
    used = set()
    for vid, r in recipes.items():
        if decisions.get(vid) == RECOMPUTE:
            used.update(r.anchors)
    groups, group_recipes = rebuild_groups(decisions, recipes, grouped)
    steps = eager_schedule(sg, decisions, prefetch, groups, group_recipes, frames)
    report = _native.simulate(sg.graph._native, steps, float(bandwidth or 1.0))
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
    return max(0.0, min(hooked) - min(plain))


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
    return max(0.0, 6.0 * (min(hooked) - min(plain)))
