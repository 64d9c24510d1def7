"""Tracing one training step of an ``nn.Module`` into a joint fx graph.

The step (forward, loss, backward) is traced with ``make_fx`` on fake tensors over
``torch.func.grad_and_value`` of a functional call of the model, functionalized so that
in-place ops (``ReLU(inplace=True)``, ``x += y``) become out-of-place ones: a recompute
then reruns a pure function of its inputs. Fake tensors also make data-dependent control
flow (``if x.sum() > 0``) fail at trace time instead of being baked in for one input.

Module hooks record which graph nodes each submodule's forward produced (reported per
module) and which module was running when tracing failed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.fx.experimental.symbolic_shapes
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.utils import _pytree as pytree

from .errors import CaptureError

# Exceptions fake tensors raise where a value, not just a shape, decides what happens next.
_DATA_DEPENDENT = tuple(
    cls
    for cls in (
        getattr(torch._subclasses.fake_tensor, "DataDependentOutputException", None),
        getattr(torch._subclasses.fake_tensor, "DynamicOutputShapeException", None),
        getattr(
            torch.fx.experimental.symbolic_shapes, "GuardOnDataDependentSymNode", None
        ),
    )
    if cls is not None
)


@dataclasses.dataclass
class Traced:
    """The joint graph and how to feed it."""

    gm: torch.fx.GraphModule
    param_names: list[str]
    buffer_names: list[str]
    input_spec: pytree.TreeSpec
    # Positions of the tensor leaves of the inputs among all leaves (the rest are constants
    # baked into the graph).
    input_tensor_positions: list[int]
    input_constants: list[Any]
    # Whether the example inputs were a dict of keyword inputs.
    keyword_inputs: bool
    # Qualified module name -> names of the fx nodes its forward produced, in order.
    module_nodes: dict[str, list[str]]


class _LossModule(torch.nn.Module):
    """Wraps model and loss so one functional call computes the loss."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable | None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, args: tuple, kwargs: dict) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(self.model, *args, **kwargs)
        out = self.model(*args, **kwargs)
        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, dict):
            loss = out.get("loss")
        if loss is None:
            loss = out
        return loss


def _check_loss(loss: Any, model: torch.nn.Module) -> torch.Tensor:
    name = type(model).__name__
    if not isinstance(loss, torch.Tensor):
        raise CaptureError(
            f"{name}: the loss is a {type(loss).__name__}, not a tensor; pass "
            "loss_fn=lambda model, *inputs: <scalar loss>"
        )
    if loss.numel() != 1 or not loss.is_floating_point():
        raise CaptureError(
            f"{name}: the loss must be a floating-point scalar, got shape "
            f"{tuple(loss.shape)} dtype {loss.dtype}; pass loss_fn=lambda model, *inputs: ..."
        )
    return loss


class _ModuleRecorder:
    """Forward hooks on every submodule: the stack of running modules (for errors) and the
    graph nodes each module's forward produced (for selective checkpointing)."""

    def __init__(self, model: torch.nn.Module):
        self.stack: list[str] = []
        self.nodes: dict[str, list[str]] = {}
        self._marks: list[Any] = []
        self._handles = []
        for name, module in model.named_modules():
            self._handles.append(
                module.register_forward_pre_hook(self._enter(name or "<root>"))
            )
            self._handles.append(
                # Not always_call: when tracing fails, the stack still shows where.
                module.register_forward_hook(self._leave(name or "<root>"))
            )
        self.failed_in: str | None = None

    def _last_node(self):
        mode = get_proxy_mode()
        if mode is None:
            return None
        graph = mode.tracer.graph
        return graph._root.prev  # the last node appended so far

    def _enter(self, name: str):
        def hook(_module, _args):
            self.stack.append(name)
            self._marks.append(self._last_node())

        return hook

    def _leave(self, name: str):
        def hook(_module, _args, _out):
            start = self._marks.pop() if self._marks else None
            if self.stack:
                self.stack.pop()
            end = self._last_node()
            if start is None or end is None:
                return
            produced = []
            node = start.next
            while node is not end.next and node.op != "root":
                produced.append(node.name)
                node = node.next
            self.nodes.setdefault(name, []).extend(produced)

        return hook

    def where(self) -> str:
        return self.stack[-1] if self.stack else "<root>"

    def remove(self):
        for h in self._handles:
            h.remove()


def trace_step(
    model: torch.nn.Module,
    example_inputs: Any,
    loss_fn: Callable | None,
) -> Traced:
    """Traces forward + loss + backward of ``model`` on ``example_inputs`` (a tuple of
    positional inputs, or a dict of keyword inputs)."""
    if isinstance(example_inputs, dict):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    else:
        args, kwargs = (example_inputs,), {}
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensor_positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    constants = list(leaves)
    for i in tensor_positions:
        constants[i] = None

    wrapper = _LossModule(model, loss_fn)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    buffers = dict(model.named_buffers())
    buffers.update(frozen)  # frozen parameters are inputs without gradients
    param_names = list(params)
    buffer_names = list(buffers)
    if not param_names:
        raise CaptureError(
            f"{type(model).__name__}: no parameter requires grad, nothing to train"
        )

    def rebuild(input_tensors):
        flat = list(constants)
        for pos, t in zip(tensor_positions, input_tensors):
            flat[pos] = t
        return pytree.tree_unflatten(flat, spec)

    def loss_of(p, b, input_tensors):
        state = {f"model.{k}": v for k, v in p.items()}
        state.update({f"model.{k}": v for k, v in b.items()})
        a, kw = rebuild(input_tensors)
        loss = torch.func.functional_call(wrapper, state, (a, kw))
        return _check_loss(loss, model).reshape(())

    def joint(p, b, input_tensors):
        grads, loss = torch.func.grad_and_value(loss_of)(p, b, input_tensors)
        return loss, [grads[k] for k in param_names]

    recorder = _ModuleRecorder(model)
    functional = torch.func.functionalize(joint, remove="mutations")
    input_tensors = [leaves[i] for i in tensor_positions]
    try:
        gm = make_fx(functional, tracing_mode="fake")(
            {k: p.detach() for k, p in params.items()},
            {k: b.detach() for k, b in buffers.items()},
            input_tensors,
        )
    except CaptureError:
        raise
    except Exception as error:  # noqa: BLE001 - re-raised with the module that failed
        raise _trace_error(error, model, recorder.where()) from error
    finally:
        recorder.remove()
    return Traced(
        gm=gm,
        param_names=param_names,
        buffer_names=buffer_names,
        input_spec=spec,
        input_tensor_positions=tensor_positions,
        input_constants=constants,
        keyword_inputs=isinstance(example_inputs, dict),
        module_nodes=recorder.nodes,
    )


def _trace_error(error: Exception, model: torch.nn.Module, where: str) -> CaptureError:
    name = type(model).__name__
    if isinstance(error, _DATA_DEPENDENT) or "data-dependent" in str(error).lower():
        what = (
            "data-dependent control flow or output shape (a graph break: a Python "
            "decision on a tensor's value, or .item()/.tolist()/nonzero())"
        )
    else:
        what = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return CaptureError(
        f"{name}: cannot trace the training step in module `{where}`: {what}",
        module=where,
    )
