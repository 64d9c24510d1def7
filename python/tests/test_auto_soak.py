"""A long run: several hundred training steps of a tiny model under ``auto_checkpoint`` at
budgets 0.5 and 0.3, offloading to a store, with sequence lengths that change (three
common ones, and a fourth now and then that pushes the least recently used plan out of a
cache of three). Nothing may creep: the process's resident memory, the plan cache, open
files and the stores' files; every planned step stays within its prediction; and at the
end both models' parameters equal a plain eager twin's, bit for bit. CPU, one thread."""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import random
import resource
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import remat.torch as rt  # noqa: E402
from test_auto import Net  # noqa: E402

STEPS = 300
MAX_PLANS = 3
COMMON = (32, 48, 64)
RARE = 96  # at these steps and the next: a fourth signature in a cache of three
RARE_AT = (60, 140, 220, 280)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def lengths() -> list[int]:
    rng = random.Random(7)
    seqs = [rng.choice(COMMON) for _ in range(STEPS)]
    for at in RARE_AT:
        seqs[at] = seqs[at + 1] = RARE
    return seqs


def batch(step: int, seq: int):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 50, (8, seq), generator=g)
    return ids, torch.roll(ids, 1, 1)


def train_step(model, opt, step, ids, labels, tracker=None):
    """One step; the forward and backward measured by ``tracker`` when given."""
    torch.manual_seed(10_000 + step)  # the same dropout masks for every model
    with tracker if tracker is not None else contextlib.nullcontext():
        loss = model(ids, labels)
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.slow  # some 300 x 3 steps, two under a dispatch mode and a tracker
def test_hundreds_of_steps_do_not_creep(tmp_path):
    # The stores live in memory where Linux has one (/dev/shm): how fast other jobs let the
    # disk go is no concern of this test, and a slow disk stalls every offloading step.
    shm = Path("/dev/shm")
    root = Path(tempfile.mkdtemp(dir=shm)) if shm.is_dir() and os.access(shm, os.W_OK) \
        else tmp_path
    try:
        _soak(root)
    finally:
        if root != tmp_path:
            shutil.rmtree(root, ignore_errors=True)


def _soak(tmp_path):
    torch.manual_seed(0)
    base = Net(d=64, layers=4, p=0.1)
    twin = copy.deepcopy(base)
    models, stores = {}, {}
    for budget in (0.5, 0.3):
        stores[budget] = tmp_path / f"store-{budget}"
        stores[budget].mkdir()
        models[budget] = rt.auto_checkpoint(copy.deepcopy(base), budget, max_plans=MAX_PLANS,
                                            store=stores[budget], bandwidth="2GB/s")
    opts = {b: torch.optim.AdamW(m.parameters(), lr=1e-3) for b, m in models.items()}
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    seen_steps: dict[int, int] = {}  # id(entry) -> planned steps seen
    rss, fds = [], []
    planned_steps = 0
    peak_unplanned = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, seq in enumerate(lengths()):
            ids, labels = batch(step, seq)
            for budget, model in models.items():
                tracker = rt.StorageTracker()
                train_step(model, opts[budget], step, ids, labels, tracker)
                c = rt.controller(model)
                assert len(c.entries) <= MAX_PLANS
                entry = next(reversed(c.entries.values()))
                if entry.plan is not None and entry.steps > seen_steps.get(id(entry), 0):
                    seen_steps[id(entry)] = entry.steps
                    planned_steps += 1
                    assert tracker.peak_bytes + entry.static_bytes <= \
                        entry.plan.predicted_peak, (step, seq, budget, c.table())
                    peak_unplanned = max(peak_unplanned, entry.plan.store_all_peak)
                assert list(stores[budget].iterdir()) == [], (step, budget)
            train_step(twin, twin_opt, step, ids, labels)
            if step % 10 == 9:
                # After a collection: what cycles of dropped profiles hold until the
                # collector's next full pass is no growth.
                gc.collect()
                rss.append(rss_bytes())
            fds.append(open_files())
    evicted = [w for w in caught if "max_plans=3" in str(w.message)]
    for budget, model in models.items():
        c = rt.controller(model)
        # Each appearance of the rare length pushes one plan out (the cache is full), and
        # each common length pushed out comes back: counted every time, warned about once.
        assert c.evictions >= len(RARE_AT), c.evictions
        assert c.plan is not None and c.plan.count("offload") + c.plan.count("recompute") > 0
        for a, b in zip(model.parameters(), twin.parameters()):
            assert torch.equal(a, b), f"budget {budget}: parameters differ from eager"
    assert len(evicted) == len(models), [str(w.message) for w in evicted]
    # The warning names the signature it dropped (its input shapes among them).
    assert any(f"[8,{n}]" in str(evicted[0].message) for n in COMMON + (RARE,))
    assert planned_steps > STEPS  # most steps of both models ran a plan
    # Open files: none kept from step to step (the stores close what they open).
    assert max(fds[-50:]) <= max(fds[50:100]), (fds[50:100], fds[-50:])
    # Resident memory: the last 50 steps no higher than steps 50-100, give or take what
    # malloc keeps of freed blocks: one unplanned step's activations per model (the
    # largest a step frees at once; glibc returns freed heap to the system only above its
    # trim threshold, which adapts to the sizes freed) and 1 MiB of the interpreter's own.
    slack = len(models) * peak_unplanned + (1 << 20)
    late, early = max(rss[-5:]), max(rss[5:10])  # (sampled every tenth step)
    assert late <= early + slack, (early, late, slack)
