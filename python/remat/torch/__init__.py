"""remat for PyTorch: capture a training step, plan it with remat, run the plan.

```python
import remat, remat.torch
captured = remat.torch.capture(model, (x, y), loss_fn=lambda m, x, y: F.cross_entropy(m(x), y))
plan = remat.plan(captured, 0.5)          # half of the store-all peak
step = remat.torch.apply(captured, plan)
loss, grads = step(x, y)                  # same bits as without the plan
step.set_grads(grads); optimizer.step()
```
"""

from .auto import AutoCheckpoint, auto_checkpoint, controller
from .capture import Captured, capture
from .errors import CaptureError, ScheduleError, StepDivergedError
from .executor import (
    Step,
    StepStats,
    apply,
    keep_everything_steps,
    plan_steps,
    set_grads,
    simulated_peak,
)
from .sac import SelectivePolicy, selective_checkpoint_policy
from .memory import StorageTracker, peak_from_profiler
from .store import FileStore, PinnedStore

__all__ = [
    "AutoCheckpoint",
    "auto_checkpoint",
    "controller",
    "StepDivergedError",
    "StorageTracker",
    "peak_from_profiler",
    "Captured",
    "CaptureError",
    "FileStore",
    "PinnedStore",
    "ScheduleError",
    "SelectivePolicy",
    "Step",
    "StepStats",
    "apply",
    "capture",
    "keep_everything_steps",
    "plan_steps",
    "selective_checkpoint_policy",
    "set_grads",
    "simulated_peak",
]
