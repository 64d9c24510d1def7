"""remat for PyTorch: plans run inside eager autograd, on the model as it is.

```python
import remat.torch
model = remat.torch.auto_checkpoint(model, memory_budget="8GiB")   # or 0.5 of activations
for batch in loader:                       # the training loop does not change
    loss = model(**batch).loss
    loss.backward(); optimizer.step(); optimizer.zero_grad()
print(remat.torch.controller(model).table())   # per module: kept / offloaded / recomputed
```

``capture(model, inputs, loss_fn)`` traces a step as remat's graph for ``remat plan``
(``captured.save("step.json")``); ``StorageTracker`` measures a step's peak on CPU.
"""

from .auto import AutoCheckpoint, auto_checkpoint, controller
from .capture import Captured, capture
from .errors import CaptureError, PlanMismatchError, StepDivergedError
from .memory import StorageTracker, peak_from_profiler
from ._store import StoreError

__all__ = [
    "AutoCheckpoint",
    "Captured",
    "CaptureError",
    "PlanMismatchError",
    "StepDivergedError",
    "StorageTracker",
    "StoreError",
    "auto_checkpoint",
    "capture",
    "controller",
    "peak_from_profiler",
]
