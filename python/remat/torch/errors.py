"""Errors of the PyTorch front end, under remat's common base when the package has one."""

from __future__ import annotations

try:  # the bindings' error hierarchy (remat.RematError), when the package provides it
    from ..errors import RematError as _Base
except ImportError:  # pragma: no cover - only while the bindings are not installed
    _Base = Exception


class CaptureError(_Base):
    """A model or step that cannot be traced or profiled; names the module or node.

    ```python
    import torch
    import remat.torch

    try:
        remat.torch.capture(torch.nn.Linear(4, 4), "not a tensor")
    except remat.torch.CaptureError as err:
        print(err)
    ```
    """

    def __init__(self, message: str, *, module: str | None = None, node: str | None = None):
        super().__init__(message)
        self.module = module
        self.node = node


class StepDivergedError(_Base):
    """A training step that ran other ops than the profiled one, where a saved tensor would
    have to be rebuilt from them: names the module and op where it diverged.

    ```python
    try:
        loss = model(batch).loss            # data-dependent control flow in the model
        loss.backward()
    except remat.torch.StepDivergedError as err:
        print(err.module, err.op)           # where the step left the profiled one
    ```
    """

    def __init__(self, message: str, *, op: str | None = None, module: str | None = None):
        super().__init__(message)
        self.op = op
        self.module = module


class PlanMismatchError(_Base):
    """A saved or shared plan that does not fit this model or step: ``source`` names the
    plan file (or the rank it came from), ``field`` what differs (``model``, ``signature``,
    ``step``, ``memory_budget``, ``format``, ``version``, ``file``).

    ```python
    try:
        model = remat.torch.auto_checkpoint(model, 0.5, plan="plan.json")
    except remat.torch.PlanMismatchError as err:
        print(err.source, err.field)        # the file, and what differs from it
    ```
    """

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None):
        super().__init__(message)
        self.source = source
        self.field = field
