"""Reproducible plans: one profile gives one plan (planned twice, in two processes, and
with its timings jittered), and a plan saved by ``controller(model).save(path)`` runs from
``auto_checkpoint(..., plan=path)`` with no planning, the same decisions and peak, and
gradients equal to eager; a file that does not fit the model, budget or input shape is
refused naming the file and what differs. CPU, one thread."""

from __future__ import annotations

import copy
import json
import math
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import remat.torch as rt  # noqa: E402
from remat.torch import _plan_file  # noqa: E402
from remat.torch._eager_plan import plan_step  # noqa: E402
from test_auto import Net, assert_identical, net_batch, train  # noqa: E402

HERE = Path(__file__).resolve().parent


def profiled(budget=0.3, seq=64, **options):
    """A model given to auto_checkpoint after one training step (profiled, not planned)."""
    torch.manual_seed(0)
    model = rt.auto_checkpoint(Net(d=32, layers=4), budget, **options)
    args, _ = net_batch(0, seq=seq)
    model(*args).backward()
    entry = next(iter(rt.controller(model).entries.values()))
    assert entry.profile is not None and entry.plan is None
    return model, entry


def record(plan, entry) -> dict:
    """What must not change: decisions, rebuild groups, predicted peak, strategy."""
    r = _plan_file.record_of(plan, _plan_file.structure(entry.profile), "", 0.3, None, {})
    return {k: r[k] for k in ("decisions", "recipes", "group_recipes", "groups",
                              "predicted_peak", "strategy", "checkpoint_modules")}


def test_one_profile_gives_one_plan():
    """The same profile planned twice gives the same plan (no clock in the planning: the
    planner's strategies run to their end, in a fixed order)."""
    _, entry = profiled()
    first = plan_step(entry.profile, entry.static_bytes, 0.3, bandwidth=None, time_limit=None)
    second = plan_step(entry.profile, entry.static_bytes, 0.3, bandwidth=None, time_limit=None)
    assert first.count("recompute") > 0
    assert record(first, entry) == record(second, entry)


def modelled_seconds(profile) -> list[float]:
    """Times that do not depend on this machine: 2 us a call plus 1 ns per byte the op
    reads and writes (so the test's outcome is the same on every run)."""
    seconds = []
    for op in profile.ops:
        refs = [x for x in list(op.leaves) + list(op.outputs) if hasattr(x, "size")]
        nbytes = sum(math.prod(r.size) * r.dtype.itemsize for r in refs)
        seconds.append(2e-6 + 1e-9 * nbytes)
    return seconds


@pytest.mark.parametrize("jitter", [0.05])
def test_jittered_timings_give_the_same_plan(jitter):
    """Each op's time moved by up to ``jitter`` either way, independently, from times that
    do not depend on the machine (four draws): the same plan, since ops are costed by
    the least time of their kind, relative to the step's typical op, on a relative grid."""
    _, entry = profiled()
    measured = modelled_seconds(entry.profile)
    for op, t in zip(entry.profile.ops, measured):
        op.seconds = t
    base = record(plan_step(entry.profile, entry.static_bytes, 0.3, bandwidth=None,
                            time_limit=None), entry)
    for seed in range(4):
        rng = random.Random(seed)
        for op, t in zip(entry.profile.ops, measured):
            op.seconds = t * math.exp(rng.uniform(-jitter, jitter))
        plan = plan_step(entry.profile, entry.static_bytes, 0.3, bandwidth=None,
                         time_limit=None)
        assert record(plan, entry) == base, f"draw {seed}"


def test_a_uniformly_slower_step_gives_the_same_plan():
    """Every op's time 1.7x (the whole machine slower: a loaded host, another rank's):
    the same plan, the ops' times being taken relative to the step's typical op."""
    _, entry = profiled()
    base = record(plan_step(entry.profile, entry.static_bytes, 0.3, bandwidth=None,
                            time_limit=None), entry)
    for op in entry.profile.ops:
        op.seconds *= 1.7
    plan = plan_step(entry.profile, entry.static_bytes, 0.3, bandwidth=None, time_limit=None)
    assert record(plan, entry) == base


_OTHER_PROCESS = textwrap.dedent("""
    import json, sys
    import torch
    torch.set_num_threads(1)
    sys.path[:0] = [{tests!r}, {package!r}]
    from test_auto_plans import profiled, record
    from remat.torch._eager_plan import plan_step
    _, entry = profiled()
    for op, t in zip(entry.profile.ops, json.load(open({times!r}))):
        op.seconds = t
    plan = plan_step(entry.profile, entry.static_bytes, 0.3, bandwidth=None, time_limit=None)
    print(json.dumps(record(plan, entry)))
""")


@pytest.mark.slow
def test_one_profile_gives_one_plan_in_another_process(tmp_path):
    """Another process profiles the same step, takes this process's op times, and plans:
    the same plan (the planner, the simulator and the plan's own choices hold no state
    and no clock)."""
    _, entry = profiled()
    times = tmp_path / "times.json"
    times.write_text(json.dumps([op.seconds for op in entry.profile.ops]))
    here = record(plan_step(entry.profile, entry.static_bytes, 0.3, bandwidth=None,
                            time_limit=None), entry)
    # (the tests' own remat: the one this process imported)
    package = str(Path(rt.__file__).resolve().parents[2])
    script = _OTHER_PROCESS.format(tests=str(HERE), package=package, times=str(times))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, cwd=HERE.parent.parent, timeout=300)
    there = json.loads(out.stdout.strip().splitlines()[-1])
    assert there == json.loads(json.dumps(here))


# ---- saved plans ---------------------------------------------------------------------------


def saved_plan(tmp_path, budget=0.3, seq=64, **options):
    """Trains a model two steps under ``budget`` and saves its plan; (path, the plan, the
    model)."""
    torch.manual_seed(0)
    model = rt.auto_checkpoint(Net(d=32, layers=4), budget, **options)
    args, _ = net_batch(0, seq=seq)
    for _ in range(2):
        model(*args).backward()
    path = tmp_path / "plan.json"
    rt.controller(model).save(path)
    return path, rt.controller(model).plan, model


def measured_peak(model, batch) -> int:
    """A step's peak from no gradients (each parameter's gradient made in the step)."""
    args, kwargs = batch
    model.zero_grad(set_to_none=True)
    with rt.StorageTracker() as tracker:
        model(*args, **kwargs).backward()
    return tracker.peak_bytes


def test_a_saved_plan_runs_without_planning(tmp_path, monkeypatch):
    """The plan file written atomically (nothing else left in the directory); a new model
    given it profiles its first step, binds the saved decisions with no planning (the
    planner is not called), predicts and measures the same peak as the model that
    planned, and trains bit-identical to eager."""
    path, plan, saver = saved_plan(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
    assert plan.count("recompute") > 0
    torch.manual_seed(0)
    base = Net(d=32, layers=4)
    batches = [net_batch(0, seq=64)]
    from remat.torch import auto

    def no_planning(*_, **__):
        raise AssertionError("a loaded plan must not be planned again")

    monkeypatch.setattr(auto, "plan_step", no_planning)
    eager = train(copy.deepcopy(base), batches)
    loaded = rt.auto_checkpoint(copy.deepcopy(base), 0.3, plan=path)
    assert_identical(eager, train(loaded, batches))
    got = rt.controller(loaded).plan
    assert {k: v for k, v in got.decisions.items()} == plan.decisions
    assert got.group_recipes == plan.group_recipes and got.strategy == plan.strategy
    assert got.predicted_peak == plan.predicted_peak
    assert measured_peak(loaded, batches[0]) == measured_peak(saver, batches[0])
    assert measured_peak(loaded, batches[0]) + rt.controller(loaded).entry().static_bytes \
        <= got.predicted_peak


def test_a_saved_plan_is_refused_for_another_model(tmp_path):
    path, _, _ = saved_plan(tmp_path)
    with pytest.raises(rt.PlanMismatchError) as e:
        rt.auto_checkpoint(Net(d=48, layers=4), 0.3, plan=path)
    assert str(path) in str(e.value) and "embed.weight" in str(e.value)
    assert e.value.field == "model"
    with pytest.raises(rt.PlanMismatchError, match="blocks.3"):
        rt.auto_checkpoint(Net(d=32, layers=3), 0.3, plan=path)


def test_a_saved_plan_is_refused_for_another_budget_or_input_shape(tmp_path):
    path, _, _ = saved_plan(tmp_path)
    with pytest.raises(rt.PlanMismatchError, match="memory_budget 0.3") as e:
        rt.auto_checkpoint(Net(d=32, layers=4), 0.5, plan=path)
    assert str(path) in str(e.value)
    model = rt.auto_checkpoint(Net(d=32, layers=4), 0.3, plan=path)
    args, _ = net_batch(0, seq=32)  # planned at 64
    with pytest.raises(rt.PlanMismatchError, match="no plan for input signature") as e:
        model(*args)
    assert e.value.field == "signature" and str(path) in str(e.value)


def test_a_saved_plan_is_refused_for_another_step(tmp_path):
    """Same parameters, module tree and input shapes, but a forward that runs other ops
    (GELU replaced by ReLU, which saves its output, not its input): refused at binding,
    naming the first op that differs."""
    path, _, _ = saved_plan(tmp_path)
    model = rt.auto_checkpoint(Net(d=32, layers=4), 0.3, plan=path)
    torch.nn.functional.gelu, saved = torch.nn.functional.relu, torch.nn.functional.gelu
    try:
        args, _ = net_batch(0, seq=64)
        model(*args).backward()
    finally:
        torch.nn.functional.gelu = saved
    with pytest.raises(rt.PlanMismatchError, match=r"another step: .* op \d+ ") as e:
        model(*args)
    assert e.value.field == "step"


def test_a_damaged_or_foreign_plan_file_is_refused(tmp_path):
    path, _, _ = saved_plan(tmp_path)
    doc = json.loads(path.read_text())
    model = Net(d=32, layers=4)
    for name, text, field in [
            ("cut.json", path.read_text()[:100], "file"),
            ("other.json", json.dumps({"format": "something"}), "format"),
            ("v9.json", json.dumps({**doc, "version": 9}), "version"),
            ("empty.json", json.dumps({**doc, "plans": []}), "plans")]:
        bad = tmp_path / name
        bad.write_text(text)
        with pytest.raises(rt.PlanMismatchError) as e:
            rt.auto_checkpoint(model, 0.3, plan=bad)
        assert e.value.field == field and str(bad) in str(e.value)
    with pytest.raises(rt.PlanMismatchError, match="cannot be read"):
        rt.auto_checkpoint(model, 0.3, plan=tmp_path / "missing.json")


def test_saving_before_a_plan_is_refused(tmp_path):
    model = rt.auto_checkpoint(Net(d=32, layers=4), 0.3)
    with pytest.raises(rt.CaptureError, match="no plan yet"):
        rt.controller(model).save(tmp_path / "plan.json")
    assert list(tmp_path.iterdir()) == []


def test_a_saved_plan_that_offloads_needs_a_store(tmp_path):
    """A CPU plan that offloads to a store, saved and loaded with a store: the same
    decisions, gradients equal to eager, no file left; loaded without a store, refused."""
    store = tmp_path / "store"
    store.mkdir()
    torch.manual_seed(0)
    base = Net(d=64, layers=4)
    batches = [net_batch(0, seq=128)]
    model = rt.auto_checkpoint(copy.deepcopy(base), 0.5, store=store, bandwidth="100GB/s")
    train(model, batches, steps=2)
    plan = rt.controller(model).plan
    assert plan.count("offload") > 0
    path = tmp_path / "plan.json"
    rt.controller(model).save(path)
    eager = train(copy.deepcopy(base), batches)
    loaded = rt.auto_checkpoint(copy.deepcopy(base), 0.5, store=store, plan=path)
    assert_identical(eager, train(loaded, batches))
    assert rt.controller(loaded).plan.decisions == plan.decisions
    assert list(store.iterdir()) == []
    no_store = rt.auto_checkpoint(copy.deepcopy(base), 0.5, plan=path)
    args, _ = batches[0]
    no_store(*args).backward()
    with pytest.raises(rt.PlanMismatchError, match="store"):
        no_store(*args)


# ---- the plan cache ------------------------------------------------------------------------


def test_the_plan_cache_says_what_it_evicts(caplog):
    """``max_plans=2`` and three input shapes in turn: the cache never holds more than two;
    every eviction is counted and logged, naming the signature dropped; the first is
    warned about, once."""
    import logging
    import warnings

    torch.manual_seed(0)
    model = rt.auto_checkpoint(Net(d=32, layers=2), 0.5, max_plans=2)
    c = rt.controller(model)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, "remat"):
        warnings.simplefilter("always")
        for seq in (16, 24, 32, 16, 24):
            args, _ = net_batch(0, seq=seq)
            model(*args).backward()
            assert len(c.entries) <= 2
    assert c.evictions == 3
    warned = [w for w in caught if "max_plans=2" in str(w.message)]
    assert len(warned) == 1 and "[8,16]" in str(warned[0].message)
    logged = [r.getMessage() for r in caplog.records if "max_plans=2" in r.getMessage()]
    assert [("[8,16]" in m, "[8,24]" in m, "[8,32]" in m) for m in logged] == [
        (True, False, False), (False, True, False), (False, False, True)]
