"""The profiled step as remat's graph (:class:`StepGraph`), the plan's types, and which
saved values can be rebuilt and from what (recipes). See ``_eager_plan`` for the notes the
whole planning of an eager step rests on."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from typing import Optional

from .._plan import Graph, as_graph
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
    """The profiled step as remat's graph (see the notes in ``_eager_plan``).

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
        # Nodes holding a storage the caller holds through the backward (the profile's note
        # 6): computed once, as autograd's backward nodes are; no plan frees or rebuilds it.
        self.held = {self.node_of(v.id) for v in values if v.held_outside and v.nbytes}
        # An op's workspace (the profile's note 4): held while its node computes, gone after.
        self.workspace = {self.op_node[op.index]: op.workspace for op in ops if op.workspace}
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
                pinned = op.phase == "backward" or not op.replayable or node in self.held
            elif kind == "part":
                # Made by its op at no cost of its own (and again when a rebuild replays it).
                op = ops[self.node_op[node]]
                phase, seconds = op.phase, 0.0
                pinned = op.phase == "backward" or not op.replayable or node in self.held
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

# Measured times are rounded to this many steps per doubling (a relative grid, about 19%
# apart) before anything is planned from them: two profiles of one step, or of one step on
# two ranks, then give the same costs unless an op's time moved across a step, so one step's
# plan does not follow the noise of its timings. The planner's choices need ratios between
# costs, not their last digits.
STEPS_PER_DOUBLING = 4


def quantized(seconds: float) -> float:
    """``seconds`` on the relative grid (:data:`STEPS_PER_DOUBLING` steps per doubling);
    0 and below stay 0."""
    if not seconds > 0.0:
        return 0.0
    return 2.0 ** (round(math.log2(seconds) * STEPS_PER_DOUBLING) / STEPS_PER_DOUBLING)


def steady_seconds(profile: Profile) -> list[float]:
    """Each op's time as the least over the step's ops of its kind: the same aten op on
    the same shapes in the same place of a repeated module (``layers.3.mlp`` and
    ``layers.0.mlp`` alike) or the same autograd node, then :func:`quantized`. Other work on
    the machine only adds to a measured time, and the profiled step is often the model's
    first, where an op's first call pays for its lazy set-up (1 ms for a small BERT's first
    GELU, 0.4 for the later ones): the least is what moves least from one profile to the
    next, and one layer's outlier does not count as that layer's cost to rebuild.

    Times are rounded relative to the step's typical op (the lower median over the ops),
    itself rounded: a machine that ran the whole step slower (another process on its
    cores, another rank's host) gives the same ratios between ops, so the same plan."""
    kinds: dict[tuple, list[int]] = {}
    for op in profile.ops:
        shapes = tuple(ref.size for ref in _refs(op.leaves))
        key = (op.name, _LAYER_INDEX.sub(".#", op.where), op.phase, shapes)
        kinds.setdefault(key, []).append(op.index)
    seconds = [0.0] * len(profile.ops)
    for members in kinds.values():
        times = sorted(profile.ops[i].seconds for i in members)
        for i in members:
            seconds[i] = times[0]
    timed = sorted(s for s in seconds if s > 0.0)
    if not timed:
        return seconds
    scale = timed[(len(timed) - 1) // 2]
    return [quantized(s / scale) * quantized(scale) for s in seconds]

def _decided(value) -> bool:
    """Whether keep / offload / recompute is decided for ``value``: autograd unpacks it."""
    return value.saved and value.first_unpack is not None

def _refs(leaves) -> list[TensorRef]:
    return [x for x in leaves if isinstance(x, TensorRef)]

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
        if value.held_outside:
            # (The profile's note 6: a rebuild would be a second copy beside the caller's.)
            reason = ("returned by the forward (the caller may keep it through the backward)"
                      if value.returned else "held outside autograd when the backward began")
        elif value.op >= forward:
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
