"""Where a CPU plan offloads: a directory of files, one per saved storage.

On a CPU device the host is the device's own memory, so copying a saved tensor "to the host"
frees nothing; a plan there recomputes only, unless the caller names a store
(``auto_checkpoint(..., store=directory)``): then an offloaded storage is written to a file
in that directory after the op that made it, its memory goes when the write is done, and it
is read back into a fresh buffer before the backward node that reads it. Bytes go out and
come back as they were, so gradients stay eager's.

Notes:

1. One worker thread does every write and read, in the order they were asked for: a value's
   read always follows its write, and the planner's one link (``bandwidth``) is what this
   thread is. File I/O releases the GIL, so the copies run beside the step's compute.
2. A write holds its storage until the bytes are in the file, and no longer: the worker drops
   its reference before the write's future completes, so once :meth:`Written.wait` returns
   the storage goes as soon as nothing else holds it (the model's own references, as in
   eager). The step waits for a write where the plan frees its value (the value's python
   death, ``_eager_run``): the planner's model, whose ``Free`` waits for its copy out. A
   store slower than the measured link then stalls the step, as the model stalls, instead
   of piling storages up behind the writer past the predicted peak.
3. The buffer a read fills is allocated on the caller's thread when the prefetch is asked
   for (where the planner counts it), not on the worker's.
4. A file is deleted when it has been read back, and when its value is dropped unread (a
   step abandoned before its backward); nothing is left in the directory after a step.
5. A write or read that fails (a full disk, the directory removed, a file changed behind
   the store's back) raises :class:`StoreError` naming the file, on the step's own thread,
   where it waits for that write or read; before it does, the store stops its worker (work
   queued behind the failure is cancelled, the thread joined) and deletes every file it
   still holds, so nothing of the failed step is left on disk or running. The next write
   starts a new worker.

Bytes in flight are bounded by the plan: the step waits for a write where its plan frees the
value (note 2), so at any write speed the storage goes where the predicted peak lets it go;
a store slower than the bandwidth the plan assumed costs time (the step stalls at that
point), never memory.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import time
import weakref
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from pathlib import Path

import torch

from ..errors import ArgumentError, RematError


class StoreError(RematError):
    """An offloaded tensor that could not be written to or read back from the store.
    Attributes: ``path`` (the file) and ``step`` ("write" or "read").

    ```python
    try:
        for batch in loader:                # a CPU model planned with store="/scratch/remat"
            model(batch).loss.backward()
    except remat.torch.StoreError as err:   # nothing of the step is left in the store
        print(err.step, err.path)           # "write" or "read", and the file
    ```
    """

    path: str | None = None
    step: str | None = None


def check_store(store) -> Path:
    """The store directory, checked before any step runs: it must exist and be writable."""
    try:
        path = Path(os.fspath(store))
    except TypeError:
        raise ArgumentError(f"store must be a directory path, got {store!r}",
                            argument="store") from None
    if not path.is_dir():
        raise ArgumentError(f"store {str(path)!r} is not a directory", argument="store")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ArgumentError(f"store {str(path)!r} is not writable", argument="store")
    return path


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous uint8 CPU tensor, without copying (no numpy needed)."""
    n = t.numel()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class FileStore:
    """One directory, one worker thread (note 1), started at the first write."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.pool: ThreadPoolExecutor | None = None
        self.names = itertools.count()
        # What this store has written and not yet deleted (note 5).
        self.outstanding: weakref.WeakSet[Written] = weakref.WeakSet()

    def _path(self) -> Path:
        return self.directory / f"remat-{os.getpid()}-{id(self):x}-{next(self.names)}.bin"

    def _worker(self) -> ThreadPoolExecutor:
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="remat-store")
        return self.pool

    def put(self, storage: torch.UntypedStorage) -> "Written":
        """Starts writing ``storage`` to a new file (note 2)."""
        raw = torch.empty(0, dtype=torch.uint8).set_(storage)
        path = self._path()
        written = Written(self, path, raw.numel())
        written.raw = raw
        del raw  # the worker's reference, in ``written``, is the one that holds it (note 2)
        # Note 4: the file goes with its value if it is never read back.
        written.finalizer = weakref.finalize(written, _remove, path)
        self.outstanding.add(written)
        written.future = self._worker().submit(_write, written)
        return written

    def get(self, written: "Written") -> "Reading":
        """Starts reading ``written`` back into a buffer made here (note 3)."""
        buffer = torch.empty(written.nbytes, dtype=torch.uint8)
        return Reading(written, self._worker().submit(_read, written, buffer))

    def abandon(self) -> None:
        """After a failed write or read (note 5): the worker stopped and joined, the work
        queued behind the failure cancelled, and every file this store holds deleted."""
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        for written in list(self.outstanding):
            written.raw = None
            written.finalizer()

    def _failed(self, written: "Written", step: str, error: BaseException) -> StoreError:
        """The error to raise for ``written``'s failed ``step``, once the store is clean."""
        self.abandon()
        return _as_store_error(error, written, step)


class Written:
    """A storage on its way to, or in, a file."""

    __slots__ = ("store", "path", "nbytes", "raw", "future", "finalizer", "__weakref__")

    def __init__(self, store: FileStore, path: Path, nbytes: int):
        self.store = store
        self.path = path
        self.nbytes = nbytes
        self.raw: torch.Tensor | None = None  # the storage, until its bytes are in the file
        self.future: Future | None = None
        self.finalizer = None

    def wait(self) -> None:
        """Returns once the bytes are in the file and the worker holds the storage no more
        (note 2); raises the write's ``StoreError`` (note 5)."""
        error = _outcome(self.future)
        if error is not None:
            raise self.store._failed(self, "write", error) from None


class Reading:
    """A file on its way back into a buffer."""

    __slots__ = ("written", "future")

    def __init__(self, written: Written, future: Future):
        self.written = written
        self.future = future

    def result(self) -> torch.Tensor:
        """The buffer, once filled; raises the read's (or its write's) ``StoreError``."""
        error = _outcome(self.future)
        if error is not None:
            raise self.written.store._failed(self.written, "read", error) from None
        return self.future.result()


def _outcome(future: Future) -> BaseException | None:
    """The error ``future`` ended with, once it has ended, without raising it: raised, the
    error (which the future keeps) would take the waiting thread's frames into its traceback,
    and with them the step's tensors, in a cycle through autograd's graph that Python's
    collector cannot see."""
    try:
        return future.exception()
    except CancelledError as cancelled:
        return cancelled


def _as_store_error(error: BaseException, written: Written, step: str) -> StoreError:
    """A new error to raise on this thread for a future's ``error`` (``_outcome``: the
    worker's own stays with its future)."""
    if isinstance(error, StoreError):
        fresh = StoreError(str(error), path=error.path, step=error.step)
        fresh.__cause__ = error.__cause__
        return fresh
    return StoreError(f"remat's {step} of an offloaded tensor ({written.nbytes} bytes) to "
                      f"{written.path} was cancelled: an earlier write or read of this store "
                      "failed", path=str(written.path), step=step)


def _write(written: Written) -> None:
    path = written.path
    raw, written.raw = written.raw, None  # nothing of the worker's holds it after this call
    try:
        if raw is None:  # abandoned (note 5) before the worker got to it
            raise OSError(f"the store was abandoned before {path} was written")
        _write_file(path, _bytes_of(raw))
    except Exception as error:  # noqa: BLE001 (any failure of a write is the store's error)
        _remove(path)
        raise StoreError(f"remat could not write an offloaded tensor ({written.nbytes} bytes) "
                         f"to {path}: {error}", path=str(path), step="write") from error
    finally:
        del raw


def _write_file(path: Path, data: memoryview) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _read_file(path: Path, buffer: memoryview) -> int:
    with open(path, "rb") as f:
        return f.readinto(buffer)


def _read(written: Written, buffer: torch.Tensor) -> torch.Tensor:
    path = written.path
    try:
        failed = _outcome(written.future)  # the write's error, if any, is this read's
        if failed is not None:
            raise _as_store_error(failed, written, "write")
        got = _read_file(path, _bytes_of(buffer))
        if got != written.nbytes:
            raise StoreError(f"remat read {got} of the {written.nbytes} bytes it wrote to "
                             f"{path}", path=str(path), step="read")
        return buffer
    except StoreError:
        buffer = None  # the error's traceback keeps this frame: not the buffer (note 5)
        raise
    except Exception as error:  # noqa: BLE001 (any failure of a read is the store's error)
        buffer = None
        raise StoreError(f"remat could not read an offloaded tensor back from {path}: {error}",
                         path=str(path), step="read") from error
    finally:
        written.finalizer()  # the file goes once read (or found unreadable)


def _remove(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@functools.lru_cache(maxsize=8)
def measure_store_bandwidth(directory: Path, nbytes: int = 16 << 20) -> float:
    """Bytes per second through the store, one way, as the worker moves them: the median of
    three rounds, each writing and reading back ``nbytes`` (the page cache included, as in
    a step). Measured once per directory and process, as CUDA's copy bandwidth is."""
    data = torch.zeros(nbytes, dtype=torch.uint8)
    path = directory / f"remat-{os.getpid()}-bandwidth.bin"
    times = []
    try:
        for _ in range(3):
            start = time.perf_counter()
            with open(path, "wb") as f:
                f.write(_bytes_of(data))
            with open(path, "rb") as f:
                f.readinto(_bytes_of(data))
            times.append(time.perf_counter() - start)
    finally:
        _remove(path)
    return 2 * nbytes / max(sorted(times)[1], 1e-9)
