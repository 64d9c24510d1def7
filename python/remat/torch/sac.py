"""A plan's keep/recompute choice as a selective activation checkpoint policy.

``torch.utils.checkpoint.create_selective_checkpoint_contexts`` asks a policy, for every
op run inside a checkpointed region (in the forward, and again in the recompute), whether
its output is saved or recomputed. The captured graph's forward nodes are the same aten
ops the policy sees (both are below autograd), so the policy maps the k-th call of an op
in the region to the k-th forward node of that op in the captured graph (of the module
named, when the region is one submodule) and answers from the plan's decision for it:

- ``MUST_SAVE``: the plan keeps (or swaps) the op's output and the backward reads it;
- ``PREFER_RECOMPUTE``: the plan recomputes it, or the backward never reads it (saving it
  would only keep it alive longer).

In-place ops (``relu_``) were functionalized in the capture; they match by name without
the trailing underscore.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .capture import Captured
from .errors import ScheduleError


def _op_key(op: Any) -> str:
    schema = getattr(op, "_schema", None)
    name = schema.name if schema is not None else str(op)
    return name.rstrip("_")


def _decisions(plan: Any) -> list[str]:
    raw = plan.decisions if hasattr(plan, "decisions") and not isinstance(plan, dict) else None
    if raw is None:
        if isinstance(plan, (str, bytes)):
            import json

            plan = json.loads(plan)
        raw = plan["decisions"]
    return [d["kind"] if isinstance(d, dict) else str(d) for d in raw]


class SelectivePolicy:
    """Per-op policies from a plan; ``context_fn(module)`` is what
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False, context_fn=...)`` takes."""

    def __init__(self, captured: Captured, plan: Any):
        kinds = _decisions(plan)
        if len(kinds) != captured.num_nodes:
            raise ScheduleError(
                f"the plan has {len(kinds)} decisions, the captured step has "
                f"{captured.num_nodes} nodes"
            )
        self.captured = captured
        self._policy = self._node_policies(kinds)

    def _node_policies(self, kinds: list[str]) -> dict[str, CheckpointPolicy]:
        """Policy of every forward op node, by fx node name."""
        nodes = self.captured.nodes
        read_in_backward = [False] * len(nodes)
        for i, n in enumerate(nodes):
            if n.phase == "backward":
                for j in n.inputs:
                    read_in_backward[j] = True
        policy: dict[str, CheckpointPolicy] = {}
        for i, n in enumerate(nodes):
            if n.fx is None or n.phase != "forward" or n.fx.target is operator.getitem:
                continue
            # A multi-output op is saved when the tensors it hands to getitems are.
            group = [i] + [self.captured.index[u] for u in n.fx.users
                           if u.target is operator.getitem and u in self.captured.index]
            if any(kinds[j] == "recompute" for j in group):
                policy[n.fx.name] = CheckpointPolicy.PREFER_RECOMPUTE
            elif any(read_in_backward[j] for j in group):
                policy[n.fx.name] = CheckpointPolicy.MUST_SAVE
            else:
                policy[n.fx.name] = CheckpointPolicy.PREFER_RECOMPUTE
        return policy

    def _sequence(self, module: str | None) -> dict[str, list[CheckpointPolicy]]:
        names = None
        if module is not None:
            produced = self.captured.traced.module_nodes.get(module)
            if produced is None:
                known = ", ".join(sorted(self.captured.traced.module_nodes)[:8])
                raise KeyError(f"no module `{module}` ran in the captured step (e.g. {known})")
            names = set(produced)
        by_op: dict[str, list[CheckpointPolicy]] = {}
        for n in self.captured.nodes:
            if n.fx is None or n.fx.name not in self._policy:
                continue
            if names is not None and n.fx.name not in names:
                continue
            by_op.setdefault(_op_key(n.fx.target), []).append(self._policy[n.fx.name])
        return by_op

    def policy_fn(self, module: str | None = None):
        """A fresh policy function for one checkpointed call of ``module`` (the whole
        forward when None): it counts the calls of each op, separately for the forward and
        the recompute, and answers the plan's choice for the k-th one."""
        sequence = self._sequence(module)
        counts: dict[tuple[bool, str], int] = {}

        def policy(ctx, op, *args, **kwargs):
            key = _op_key(op)
            seen = counts.get((ctx.is_recompute, key), 0)
            counts[(ctx.is_recompute, key)] = seen + 1
            choices = sequence.get(key)
            if not choices or seen >= len(choices):
                return CheckpointPolicy.PREFER_RECOMPUTE
            return choices[seen]

        return policy

    def context_fn(self, module: str | None = None):
        """For ``checkpoint(fn, ..., use_reentrant=False, context_fn=...)``."""
        return functools.partial(self._contexts, module)

    def _contexts(self, module):
        return create_selective_checkpoint_contexts(self.policy_fn(module))

    def counts(self, module: str | None = None) -> dict[str, int]:
        """How many forward ops the policy saves and recomputes (for reports)."""
        out = {"save": 0, "recompute": 0}
        for choices in self._sequence(module).values():
            for c in choices:
                out["save" if c == CheckpointPolicy.MUST_SAVE else "recompute"] += 1
        return out


def selective_checkpoint_policy(captured: Captured, plan: Any) -> SelectivePolicy:
    """The plan's keep/recompute choice as a ``SelectivePolicy``."""
    return SelectivePolicy(captured, plan)
