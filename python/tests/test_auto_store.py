"""A CPU plan's file store (``remat.torch._store``): bytes in flight bounded by the plan at
any write speed, and a failing store that raises ``StoreError`` and leaves nothing behind.

The writer is swapped for one that is fast (as the disk is), sleeps before every write, or
is as slow as a store may legally be (each write finishes only when the step waits for it,
where its plan frees the value): the measured peak stays within the predicted one and the
run equals eager's bit for bit, with no timing asserted. Failures are injected (a write that
raises, a full disk, the directory removed during a step, a read that fails): the error
names the file, no file is left, the store's worker thread is gone, no storage of the
failed step is still held, and the next step runs. CPU, one thread.
"""

from __future__ import annotations

import copy
import errno
import gc
import shutil
import threading
import time

import pytest

torch = pytest.importorskip("torch")

import remat.torch as rt  # noqa: E402
from remat.torch import _store  # noqa: E402
from test_auto import Net, assert_identical, net_batch, train  # noqa: E402

# A link far faster than the disk, so that the plan offloads and the writes lag behind it.
LINK = "100GB/s"


def number_of(path) -> int:
    """A store file's sequence number (``remat-<pid>-<store>-<n>.bin``): the order of its
    write on the one worker."""
    return int(path.stem.rsplit("-", 1)[1])


class Slowest:
    """A writer as slow as the store may be: write ``n`` waits until the step waits for it
    or for a later one (the worker writes in order), then writes. A write never released
    fails after a minute (a step that never waited would hang, not pass)."""

    def __init__(self, monkeypatch):
        self.cond = threading.Condition()
        self.released = -1
        self.held_back = 0
        write, wait = _store._write_file, _store.Written.wait

        def gated_write(path, data):
            with self.cond:
                if self.released < number_of(path):
                    self.held_back += 1
                if not self.cond.wait_for(lambda: self.released >= number_of(path), 60):
                    raise OSError(f"{path}: the step never waited for this write")
            write(path, data)

        def releasing_wait(written):
            with self.cond:
                self.released = max(self.released, number_of(written.path))
                self.cond.notify_all()
            wait(written)

        monkeypatch.setattr(_store, "_write_file", gated_write)
        monkeypatch.setattr(_store.Written, "wait", releasing_wait)


def sleeping(monkeypatch):
    write = _store._write_file

    def slow(path, data):
        time.sleep(0.02)
        write(path, data)

    monkeypatch.setattr(_store, "_write_file", slow)


@pytest.mark.parametrize("writer", ["fast", "sleeping", "slowest"])
def test_bytes_in_flight_stay_within_the_prediction_at_any_write_speed(
        tmp_path, monkeypatch, writer):
    """Whatever the store's speed, an offloaded value's storage goes where its plan frees
    it (the step waits there for its write): the measured peak is within the prediction,
    three AdamW steps equal eager's, and no file is left."""
    torch.manual_seed(0)
    base = Net(d=64, layers=4)
    batches = [net_batch(0, seq=128)]
    eager = train(copy.deepcopy(base), batches)
    slowest = None
    if writer == "sleeping":
        sleeping(monkeypatch)
    elif writer == "slowest":
        slowest = Slowest(monkeypatch)
    model = rt.auto_checkpoint(copy.deepcopy(base), 0.5, store=tmp_path, bandwidth=LINK)
    assert_identical(eager, train(model, batches))
    plan = rt.controller(model).plan
    assert plan.count("offload") > 1, rt.controller(model).table()
    (args, kwargs), = batches
    with rt.StorageTracker() as tracker:
        model(*args, **kwargs).backward()
    assert tracker.peak_bytes + rt.controller(model).entry().static_bytes <= plan.predicted_peak
    assert list(tmp_path.iterdir()) == []
    if slowest is not None:
        assert slowest.held_back > 0  # writes did wait for the step


def fail_on_call(monkeypatch, name: str, k: int, error):
    """``_store.<name>`` raises ``error(path)`` from its ``k``-th call on (counted from 1)."""
    real = getattr(_store, name)
    calls = [0]

    def failing(path, data):
        calls[0] += 1
        if calls[0] >= k:
            raise error(path)
        return real(path, data)

    monkeypatch.setattr(_store, name, failing)
    return lambda: monkeypatch.setattr(_store, name, real)


def full_disk(path):
    return OSError(errno.ENOSPC, "No space left on device", str(path))


def broken_writer(path):
    return RuntimeError("the writer broke")


def unreadable(path):
    return OSError(errno.EIO, "Input/output error", str(path))


def removing_directory(path):
    shutil.rmtree(path.parent)
    return FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))


FAILURES = {
    "full disk": ("_write_file", full_disk, "write", "No space left on device"),
    "a write that raises": ("_write_file", broken_writer, "write", "the writer broke"),
    "directory removed": ("_write_file", removing_directory, "write", "No such file"),
    "a read that fails": ("_read_file", unreadable, "read", "Input/output error"),
}


@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_failing_store_raises_and_leaves_nothing_behind(tmp_path, monkeypatch, failure):
    name, error, step, says = FAILURES[failure]
    store = tmp_path / "store"
    store.mkdir()
    torch.manual_seed(0)
    model = rt.auto_checkpoint(Net(d=64, layers=4), 0.5, store=store, bandwidth=LINK)
    (args, kwargs), = [net_batch(0, seq=128)]
    for _ in range(2):  # profiled, then planned: the store's worker is running
        model(*args, **kwargs).backward()
        model.zero_grad(set_to_none=True)
    control = rt.controller(model)
    assert control.plan.count("offload") > 1
    workers = list(control.store.pool._threads)
    assert workers and all(t.is_alive() for t in workers)
    restore = fail_on_call(monkeypatch, name, 2, error)
    with rt.StorageTracker() as tracker:
        with pytest.raises(rt.StoreError) as info:
            model(*args, **kwargs).backward()
        message, path, where = str(info.value), info.value.path, info.value.step
        del info
        gc.collect()
        tracker._expire()
        grads = {p.grad.untyped_storage()._cdata: p.grad.untyped_storage().nbytes()
                 for p in model.parameters() if p.grad is not None}
        # Nothing of the failed step is held but the gradients its backward accumulated.
        assert tracker.live_bytes == sum(grads.values()), (tracker.live_bytes, grads)
    assert where == step and says in message
    assert path.startswith(str(store)) and path.endswith(".bin") and path in message
    assert not store.exists() or list(store.iterdir()) == []
    assert control.store.pool is None
    assert not any(t.is_alive() for t in workers)
    # The failure was the store's, not the model's: the next step runs and cleans up.
    restore()
    store.mkdir(exist_ok=True)
    model.zero_grad(set_to_none=True)
    model(*args, **kwargs).backward()
    assert list(store.iterdir()) == []
