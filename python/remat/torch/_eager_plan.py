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
7. An anchor autograd saves may be offloaded: copied to the host once the forward has
   written it last, gone from the device at its python death like any offloaded value,
   and fetched back by its prefetch or, at the latest, by the first rebuild that reads it
   (which waits for the copy). "Checkpoint each layer, offload its input" is such a plan:
   the module-segment family offers it where a link is given.
8. One profile gives one plan. The planner's search is anytime: it improves its plan until
   a deadline, so what it returns depends on how fast the machine ran it. Without a time
   limit the step is planned with a fixed list of the planner's strategies, each run to its
   end (deterministic given the graph), in a fixed order, and the module-segment family
   beside them; the cheapest plan that fits is taken, the earlier on a tie. A caller's
   ``time_limit`` adds the search under that limit (a plan that may then differ from run to
   run). The graph's times are the least over repeated calls and ops of a kind, on a
   relative grid (``steady_seconds``), so the noise of one op's timing does not reach the
   planner.
"""

from __future__ import annotations

import re
from typing import Optional

from .._plan import plan as rust_plan
from .. import _native
from ..errors import BudgetError
from ._eager_profile import Profile

# The planning of an eager step lives in four modules: the graph and the plan's types
# (``_eager_graph``), the schedule eager runs under a plan and its judgement
# (``_eager_schedule``), the checkpoint family (``_eager_segments``), and this front door.
from ._eager_graph import (KEEP, OFFLOAD, RECOMPUTE, EagerPlan, StepGraph,  # noqa: F401
                           _recipes, mark_recomputable)
from ._eager_schedule import _evaluate
from ._eager_segments import (_checkpoint_only, _descend, _module_segments,  # noqa: F401
                              _recompute_everything)

# The planner's strategies an eager step is planned with when no time limit is given (note
# 8), in the order ties are broken in.
REPRODUCIBLE_STRATEGIES = ("evict", "mutwo-refined", "mutwo", "chen-greedy")


def plan_step(profile: Profile, static_bytes: int, budget, *, bandwidth: Optional[float],
              time_limit: Optional[float], strategy: Optional[str] = None) -> EagerPlan:
    """Plans the profiled step under ``budget`` (bytes of the step's peak, or a float
    fraction of its activation bytes: the store-all peak above the static bytes and the
    parameters' gradients).

    ``bandwidth``: host copies per second for offload, None for recompute only.
    ``strategy``: a strategy of the Rust planner, the only one then; ``"checkpoint"``: the
    best plan run by ``torch.utils.checkpoint`` around modules (note 5), or none.
    Modules whose re-run would change what the caller holds are never checkpointed
    (``_eager_segments._rerun_changes``).
    """
    mark_recomputable(profile)
    sg = StepGraph(profile, static_bytes)
    graph = sg.graph
    # The unplanned step as eager runs it, its ops' workspaces included (the profile's
    # note 4): the peak a fraction budget is a fraction of, and the plan a budget at or
    # above it keeps.
    keep_all = _evaluate(sg, {}, {}, {}, bandwidth, 0, "keep", graph.store_all_peak)
    store_all = max(graph.store_all_peak, keep_all.predicted_peak)
    # Gradients that outlive the step (the parameters' .grad) are no activations: a fraction
    # budget leaves them whole.
    kept_grads = sum(v.nbytes for v in profile.values
                     if v.op >= profile.forward_ops and v.expiry == len(profile.ops))
    budget_bytes = _budget_bytes(budget, store_all, static_bytes + kept_grads)
    keep_all.budget_bytes, keep_all.store_all_peak = budget_bytes, store_all
    keep_all.unplanned = keep_all.report
    if keep_all.predicted_peak <= budget_bytes:
        return keep_all
    keep_all.decisions = {v.id: KEEP for v in profile.values
                          if v.saved and v.first_unpack is not None}
    if strategy == "checkpoint":
        return _checkpoint_only(sg, bandwidth, budget_bytes, store_all, keep_all)
    best: Optional[EagerPlan] = None
    tried: list[EagerPlan] = [keep_all]
    # Note 8: the planner's strategies in a fixed order, each run to its end; the clock-bound
    # search only when the caller gives a time limit. Ties go to the earlier.
    names = [strategy] if strategy else list(REPRODUCIBLE_STRATEGIES)
    if strategy is None and time_limit is not None:
        names.append(None)
    for name in names:
        candidate = _propose(sg, name, time_limit, bandwidth, budget_bytes, static_bytes,
                             store_all, tried)
        if candidate is not None and (best is None or candidate.cost < best.cost):
            best = candidate
    # A strategy the caller names is the planner's only (no module segments beside it).
    segmented = [] if strategy else _module_segments(sg, bandwidth, budget_bytes, store_all)
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

def _propose(sg: StepGraph, strategy: Optional[str], time_limit: Optional[float],
             bandwidth: Optional[float], budget_bytes: int, static_bytes: int, store_all: int,
             tried: list[EagerPlan]) -> Optional[EagerPlan]:
    """The planner's ``strategy`` (None: its search) at decreasing planner budgets until
    the eager schedule of its proposal fits (note 1); the first that fits, or None. Every
    proposal judged is appended to ``tried``."""
    graph = sg.graph
    link = bandwidth if bandwidth else 1.0
    floor = graph.memory_floor
    # The eager schedule holds more than the planner's where the planner uses what eager
    # cannot (note 1), so ask for less by the excess; where the planner finds nothing,
    # bisect toward the last budget it met.
    high, target = budget_bytes, budget_bytes
    low = floor
    step = max(1, (budget_bytes - static_bytes) // 100)
    for _ in range(8):
        if target < floor:
            break
        try:
            proposal = rust_plan(graph, int(target), strategy=strategy, bandwidth=link,
                                 time_limit=time_limit if strategy is None else None)
        except BudgetError:
            low = target
            target = (low + high) // 2
            if high - low <= step:
                break
            continue
        candidate = _from_proposal(sg, proposal, bandwidth, budget_bytes, store_all)
        tried.append(candidate)
        if candidate.predicted_peak <= budget_bytes:
            return candidate
        high = target
        target = max(low, min(target - (candidate.predicted_peak - budget_bytes),
                              target - step))
    return None


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
    swapped_sources: set[int] = set()
    for value in profile.values:
        if not value.saved or value.first_unpack is None:
            continue
        d = decisions_by_node[sg.node_of(value.id)]
        kind = d.get("kind")
        if kind == "recompute" and value.recomputable:
            decisions[value.id] = RECOMPUTE
            for src in d.get("from", ()):
                # A source the planner keeps is held from the forward (an anchor); one it
                # swaps is an offloaded anchor where autograd saves it (note 7); one it
                # recomputes itself is rebuilt on the way (or found rebuilt already).
                if sg.kinds[src] != "op" or sg.node_op[src] >= profile.forward_ops:
                    continue
                source_kind = decisions_by_node[src].get("kind")
                if source_kind == "keep":
                    anchors.update(by_op.get(sg.node_op[src], ()))
                elif source_kind == "swap":
                    swapped_sources.update(by_op.get(sg.node_op[src], ()))
        elif kind == "swap" and bandwidth and not value.held_outside and all(
                w < profile.forward_ops for w in value.writers):
            decisions[value.id] = OFFLOAD
            at = sg.node_op[int(d.get("prefetch_at", sg.op_node[value.first_unpack]))]
            prefetch[value.id] = min(at, value.first_unpack)
        else:
            decisions[value.id] = KEEP
    # Anchors are held, never rebuilt; a value both anchor and recompute stays an anchor.
    for a in list(anchors):
        if decisions.get(a) == RECOMPUTE:
            decisions[a] = KEEP
    anchors.update(v for v in swapped_sources if decisions.get(v) == OFFLOAD)
    # Saved values that stay are held by autograd anyway: rebuilds start from them too.
    anchors.update(v for v, d in decisions.items() if d == KEEP)
    recipes = _recipes(profile, decisions, anchors)
    return _evaluate(sg, decisions, recipes, prefetch, bandwidth, budget_bytes,
                     proposal.strategy, store_all, anchors)
