"""The captured step as remat sees it: one IR node per fx ``call_function`` node.

Placeholders (parameters, buffers, the step's inputs) and graph constants are static:
resident for the whole step, counted in ``static_bytes``, not nodes. Every other fx node
becomes one IR node, in the fx order (a topological order), plus a final ``end:step``
node reading the step's outputs (the loss and the gradients), which therefore live to the
end of the step as the engine's gradients do.

Bytes are counted per storage, as measured on a real run (see ``_profile``):

- a node whose output is a new storage owns it: ``output_bytes`` is its size;
- a view or alias (``t``, ``view``, ``expand``, a ``split`` piece) owns nothing and has
  0 bytes, but its readers also read the storage's owner (its *root*), so the root stays
  on the device while any view of it is used;
- an op with several outputs counts every new storage it makes, and each ``getitem`` of
  one of them takes over that storage as its own tensor (so unused outputs die with the
  op, used ones live as long as their readers need them).
"""

from __future__ import annotations

import dataclasses
import operator

import torch

# Batch-norm kernels update running statistics in place without an alias annotation in
# their schema; a recompute must not apply the update a second time. Value: the argument
# positions of the statistics.
_STATS_IN_PLACE = {
    "aten::native_batch_norm": (3, 4),
    "aten::_native_batch_norm_legit": (3, 4),
    "aten::cudnn_batch_norm": (3, 4),
    "aten::miopen_batch_norm": (3, 4),
    "aten::_batch_norm_with_update": (3, 4),
}


@dataclasses.dataclass
class IRNode:
    name: str
    fx: torch.fx.Node | None  # None for end:step
    phase: str = "forward"
    compute_us: float = 0.0
    output_bytes: int = 0
    inputs: list[int] = dataclasses.field(default_factory=list)
    # Nodes whose storages this node's output aliases (its roots); empty for owners.
    roots: list[int] = dataclasses.field(default_factory=list)
    # True when the output owns no storage (a pure view): it can be rebuilt for free.
    is_view: bool = False
    # Random op (nondeterministic_seeded): its generator state is replayed on recompute.
    is_random: bool = False
    # Argument positions a recompute must pass as copies (in-place updates of statics).
    copy_on_recompute: tuple[int, ...] = ()


def op_name(fx_node: torch.fx.Node) -> str:
    target = fx_node.target
    if target is operator.getitem:
        return "getitem"
    schema = getattr(target, "_schema", None)
    return schema.name if schema is not None else str(target)


def is_random(fx_node: torch.fx.Node) -> bool:
    tags = getattr(fx_node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def copy_positions(fx_node: torch.fx.Node) -> tuple[int, ...]:
    """Argument positions whose tensors the op writes in place (from its schema, plus the
    batch-norm statistics, which the schema does not mark)."""
    schema = getattr(fx_node.target, "_schema", None)
    if schema is None:
        return ()
    positions = set(_STATS_IN_PLACE.get(schema.name, ()))
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            positions.add(i)
    return tuple(sorted(p for p in positions if p < len(fx_node.args)))


def fx_inputs(fx_node: torch.fx.Node) -> list[torch.fx.Node]:
    """The fx nodes a node reads, each once, in first-use order."""
    seen: dict[torch.fx.Node, None] = {}
    torch.fx.node.map_arg((fx_node.args, fx_node.kwargs), lambda n: seen.setdefault(n))
    return list(seen)


def tensor_leaves(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensor_leaves(v)]
    return []
