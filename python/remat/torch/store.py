"""Host stores for swapped tensors.

A store copies a node's value off the device (``put``), and back (``get`` starts the copy,
``take`` waits for it and returns the value). Copies run beside the computation:

- ``FileStore`` (CPU devices): one file per storage, written by a writer thread and read
  back by a prefetch thread as soon as the schedule's ``swap_in`` is issued, ahead of the
  node that reads it. This is the CPU stand-in for host memory, so that the swap path of
  a plan really runs (and is tested) on a machine without an accelerator.
- ``PinnedStore`` (CUDA): pinned host buffers, one copy stream per direction, events to
  order them with the compute stream.

A value is a tensor or a tuple/list of tensors and constants; tensors sharing a storage are
saved once and rebuilt as views of one new storage, with their offsets and strides.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.utils import _pytree as pytree


@dataclasses.dataclass
class _Layout:
    """How to rebuild a value from its saved storages."""

    spec: pytree.TreeSpec
    # One entry per leaf: ("t", storage index, dtype, offset, size, stride) or ("c", value).
    leaves: list[tuple]
    nbytes: list[int]


def _layout(value: Any) -> tuple[_Layout, list[torch.Tensor]]:
    leaves, spec = pytree.tree_flatten(value)
    slots: dict[int, int] = {}
    raw: list[torch.Tensor] = []
    entries = []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            entries.append(("c", leaf))
            continue
        storage = leaf.untyped_storage()
        slot = slots.get(storage.data_ptr())
        if slot is None:
            slot = slots[storage.data_ptr()] = len(raw)
            # Bytes of the whole storage, as a uint8 tensor: holds it alive until copied.
            raw.append(
                torch.empty(0, dtype=torch.uint8, device=leaf.device).set_(storage)
            )
        entries.append(
            ("t", slot, leaf.dtype, leaf.storage_offset(), tuple(leaf.shape), leaf.stride())
        )
    return _Layout(spec, entries, [r.numel() for r in raw]), raw


def _rebuild(layout: _Layout, raw: list[torch.Tensor]) -> Any:
    leaves = []
    for entry in layout.leaves:
        if entry[0] == "c":
            leaves.append(entry[1])
            continue
        _, slot, dtype, offset, size, stride = entry
        t = torch.empty(0, dtype=dtype, device=raw[slot].device)
        t.set_(raw[slot].untyped_storage(), offset, size, stride)
        leaves.append(t)
    return pytree.tree_unflatten(leaves, layout.spec)


class FileStore:
    """Swapped tensors in files (one per storage) under a private temporary directory,
    written by a writer thread, read back ahead of use by a prefetch thread."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self.directory = tempfile.mkdtemp(prefix="remat-swap-", dir=directory)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="remat-swap-out")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="remat-swap-in")
        self._writes: dict[int, tuple[Future, _Layout, list[str]]] = {}
        self._version = 0
        self._lock = threading.Lock()
        self.bytes_out = 0
        self.bytes_in = 0
        self.files_written = 0
        self._finalizer = weakref.finalize(self, _remove_store, self.directory,
                                           self._writer, self._reader)

    def put(self, key: int, value: Any) -> None:
        layout, raw = _layout(value)
        self._version += 1
        paths = [
            os.path.join(self.directory, f"t{key}-v{self._version}-s{i}.bin")
            for i in range(len(raw))
        ]
        future = self._writer.submit(self._write, raw, paths)
        self._writes[key] = (future, layout, paths)
        self.bytes_out += sum(layout.nbytes)

    def _write(self, raw: list[torch.Tensor], paths: list[str]) -> None:
        for tensor, path in zip(raw, paths):
            with open(path, "wb") as f:
                f.write(memoryview(tensor.numpy()))
        with self._lock:
            self.files_written += len(paths)

    def wait_put(self, key: int) -> None:
        """Waits until the copy of ``key`` is on disk (before its device bytes are freed)."""
        self._writes[key][0].result()

    def get(self, key: int) -> Future:
        """Starts reading ``key`` back on the prefetch thread."""
        if key not in self._writes:
            raise KeyError(f"node {key} was never swapped out")
        future, layout, paths = self._writes[key]
        self.bytes_in += sum(layout.nbytes)
        return self._reader.submit(self._read, future, layout, paths)

    @staticmethod
    def _read(write: Future, layout: _Layout, paths: list[str]) -> Any:
        write.result()
        raw = [
            torch.from_file(path, shared=False, size=n, dtype=torch.uint8)
            for path, n in zip(paths, layout.nbytes)
        ]
        return _rebuild(layout, raw)

    def take(self, handle: Future) -> Any:
        return handle.result()

    def clear(self) -> None:
        """Deletes every file of the finished step."""
        for future, _, paths in self._writes.values():
            future.result()
            for path in paths:
                if os.path.exists(path):
                    os.unlink(path)
        self._writes.clear()

    def close(self) -> None:
        self._finalizer()


def _remove_store(directory: str, writer: ThreadPoolExecutor, reader: ThreadPoolExecutor):
    writer.shutdown(wait=True)
    reader.shutdown(wait=True)
    shutil.rmtree(directory, ignore_errors=True)


class PinnedStore:
    """Swapped tensors in pinned host memory, copied on one side stream per direction."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._d2h = torch.cuda.Stream(self.device)
        self._h2d = torch.cuda.Stream(self.device)
        self._writes: dict[int, tuple[torch.cuda.Event, _Layout, list[torch.Tensor]]] = {}
        self.bytes_out = 0
        self.bytes_in = 0

    def put(self, key: int, value: Any) -> None:
        layout, raw = _layout(value)
        compute = torch.cuda.current_stream(self.device)
        host = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in layout.nbytes]
        self._d2h.wait_stream(compute)
        with torch.cuda.stream(self._d2h):
            for h, r in zip(host, raw):
                h.copy_(r, non_blocking=True)
                # The caching allocator must not hand these bytes out again before the
                # copy has read them, even once the executor frees the tensor.
                r.record_stream(self._d2h)
            done = torch.cuda.Event()
            done.record(self._d2h)
        self._writes[key] = (done, layout, host)
        self.bytes_out += sum(layout.nbytes)

    def wait_put(self, key: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self._writes[key][0])

    def get(self, key: int):
        written, layout, host = self._writes[key]
        with torch.cuda.stream(self._h2d):
            self._h2d.wait_event(written)
            raw = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in layout.nbytes]
            for d, h in zip(raw, host):
                d.copy_(h, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._h2d)
        self.bytes_in += sum(layout.nbytes)
        return done, layout, raw

    def take(self, handle) -> Any:
        done, layout, raw = handle
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(done)
        for r in raw:
            r.record_stream(compute)
        return _rebuild(layout, raw)

    def clear(self) -> None:
        self._writes.clear()

    def close(self) -> None:
        self.clear()


def default_store(device: torch.device):
    device = torch.device(device)
    if device.type == "cuda":
        return PinnedStore(device)
    return FileStore()
