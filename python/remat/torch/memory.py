"""Measuring a step's memory without trusting the code that plans it.

On CUDA the device's allocator says it: ``torch.cuda.max_memory_allocated``. A CPU has no
such counter, so :class:`StorageTracker` keeps one: a dispatch mode that sees every op of the
step (forward, backward, and any recomputation in between) and every storage those ops make,
and after each op adds up the bytes of the storages still alive. It shares nothing with
remat's profiler or runtime; ``peak_from_profiler`` reads the same quantity off
``torch.profiler``'s allocation events, and the tests check that the two agree.

```python
with StorageTracker() as tracker:
    model(x).sum().backward()
print(tracker.peak_bytes)      # storages made inside the block, at most alive at once
```
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class StorageTracker(TorchDispatchMode):
    """Peak bytes of the storages made inside the ``with`` block (CPU or CUDA).

    ```python
    import torch
    from remat.torch import StorageTracker

    x = torch.randn(256, 256, requires_grad=True)
    with StorageTracker() as tracker:
        (x @ x).relu().sum().backward()
    print(tracker.peak_bytes)               # the step's peak, in bytes
    ```
    """

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[int, int]] = {}  # cdata -> (weak ref, bytes)
        self.external: dict[int, int] = {}  # cdata -> weak ref, storages made before
        self.live_bytes = 0
        self.peak_bytes = 0
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._expire()
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                self._note_external(t)
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return out

    def _note_external(self, t: torch.Tensor) -> None:
        """A storage read before any op made it was made before the block: its views (a
        weight's transpose) and in-place results are not new bytes."""
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = storage._cdata
        if key not in self.live and key not in self.external:
            self.external[key] = storage._weak_ref()

    def _add(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = storage._cdata
        if key in self.live or key in self.external or storage.nbytes() == 0:
            return
        self.live[key] = (storage._weak_ref(), storage.nbytes())
        self.live_bytes += storage.nbytes()

    def _expire(self) -> None:
        dead = [k for k, (w, _) in self.live.items() if torch.UntypedStorage._expired(w)]
        for k in dead:
            w, n = self.live.pop(k)
            torch.UntypedStorage._free_weak_ref(w)
            self.live_bytes -= n
        gone = [k for k, w in self.external.items() if torch.UntypedStorage._expired(w)]
        for k in gone:
            torch.UntypedStorage._free_weak_ref(self.external.pop(k))

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        self._expire()
        for w, _ in self.live.values():
            torch.UntypedStorage._free_weak_ref(w)
        for w in self.external.values():
            torch.UntypedStorage._free_weak_ref(w)
        self.live.clear()
        self.external.clear()
        return result


def peak_from_profiler(step) -> int:
    """Peak of the bytes allocated and not yet freed while ``step()`` runs, from
    ``torch.profiler``'s memory events (CPU).

    ```python
    import torch
    from remat.torch import peak_from_profiler

    x = torch.randn(256, 256, requires_grad=True)
    print(peak_from_profiler(lambda: (x @ x).relu().sum().backward()))
    ```
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak
