"""remat.torch.auto_checkpoint: plans run inside eager autograd, bit-identical to plain eager.

Every case trains a copy of one model two ways, plain eager and under ``auto_checkpoint``,
for three AdamW steps from the same random state, and compares losses, gradients,
parameters, buffers and the generator state bit for bit. CPU, one thread.
"""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")

import remat  # noqa: E402
import remat.torch as rt  # noqa: E402

F = torch.nn.functional


class Block(torch.nn.Module):
    def __init__(self, d, p):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class Net(torch.nn.Module):
    """Residual MLP blocks, a tied embedding / head, loss inside the forward."""

    def __init__(self, d=32, layers=4, p=0.1, vocab=50):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(Block(d, p) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids, labels):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class ConvNet(torch.nn.Module):
    """BatchNorm (running statistics updated in place) and in-place ReLU, in residual
    blocks."""

    def __init__(self, blocks=4, width=8):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, width, 3, padding=1)
        self.convs = torch.nn.ModuleList(
            torch.nn.Conv2d(width, width, 3, padding=1) for _ in range(blocks))
        self.norms = torch.nn.ModuleList(torch.nn.BatchNorm2d(width) for _ in range(blocks))
        self.fc = torch.nn.Linear(width, 5)

    def forward(self, x, y):
        h = self.stem(x)
        for conv, norm in zip(self.convs, self.norms):
            h = h + F.relu(norm(conv(h)), inplace=True)
        h = h.relu_()
        return F.cross_entropy(self.fc(h.mean((2, 3))), y)


def net_batch(seed=0, seq=64):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (8, seq), generator=g)
    return (ids, torch.roll(ids, 1, 1)), {}


def conv_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 5, (8,), generator=g)), {}


def train(model, batches, *, steps=3, seed=1, autocast=False):
    """Three AdamW steps; returns everything that must match."""
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for i in range(steps):
        args, kwargs = batches[i % len(batches)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(*args, **kwargs)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {
        "losses": losses,
        "grads": grads,
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": [{k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
                for s in opt.state.values()],
        "rng": torch.get_rng_state(),
    }


def assert_identical(a, b):
    assert len(a["losses"]) == len(b["losses"])
    for x, y in zip(a["losses"], b["losses"]):
        assert torch.equal(x, y), (x, y)
    for ga, gb in zip(a["grads"], b["grads"]):
        assert ga.keys() == gb.keys()
        for k in ga:
            assert torch.equal(ga[k], gb[k]), f"gradient of {k} differs"
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert torch.equal(a["state"][k], b["state"][k]), f"state {k} differs"
    for sa, sb in zip(a["opt"], b["opt"]):
        for k in sa:
            assert torch.equal(sa[k], sb[k])
    assert torch.equal(a["rng"], b["rng"])


def compare(make, batches, budget, *, autocast=False, steps=3):
    torch.manual_seed(0)
    base = make()
    eager = train(copy.deepcopy(base), batches, autocast=autocast, steps=steps)
    model = rt.auto_checkpoint(copy.deepcopy(base), budget)
    planned = train(model, batches, autocast=autocast, steps=steps)
    assert_identical(eager, planned)
    return rt.controller(model)


@pytest.mark.parametrize("budget", [1.0, 0.8, 0.6])
def test_dropout_tied_weights_identical_at_every_budget(budget):
    c = compare(Net, [net_batch()], budget)
    plan = c.plan
    assert plan is not None
    assert plan.predicted_peak <= plan.budget_bytes
    if budget < 1.0:
        assert plan.count("recompute") > 0, c.table()
    else:
        assert plan.keeps_everything


def measured_peak(model, batch):
    """The step's peak as the storage tracker sees it, plus the static bytes."""
    args, kwargs = batch

    def step():
        model(*args, **kwargs).backward()
        model.zero_grad(set_to_none=True)

    with rt.StorageTracker() as tracker:
        step()
    entry = rt.controller(model).entry()
    return tracker.peak_bytes + entry.static_bytes, step


def test_measured_peak_within_predicted_and_lower_budgets_measure_lower():
    torch.manual_seed(0)
    base = Net(d=64, layers=4)
    batch = net_batch(seq=64)
    measured = []
    for budget in (1.0, 0.8, 0.6):
        model = rt.auto_checkpoint(copy.deepcopy(base), budget)
        args, _ = batch
        for _ in range(2):
            model(*args).backward()
            model.zero_grad(set_to_none=True)
        peak, step = measured_peak(model, batch)
        plan = rt.controller(model).plan
        # Tolerance: none on CPU; the tracker counts storages the step's ops make.
        assert peak <= plan.predicted_peak, (budget, peak, plan.predicted_peak)
        assert plan.predicted_peak <= plan.budget_bytes
        measured.append(peak)
    assert measured == sorted(measured, reverse=True), measured
    assert measured[-1] < 0.8 * measured[0]


def test_an_ops_workspace_counts_where_it_runs_replays_included():
    """A CUDA op's workspace (the allocator's peak above what the op leaves, profile note
    4) is held while its node computes: set here on the profile of a CPU step, it must top
    the live bytes at every compute of that op in the schedule, replays included; the
    planner must fit a budget with it, and a budget of 1.0 must still keep everything."""
    from remat.torch._eager_plan import plan_step

    torch.manual_seed(0)
    model = rt.auto_checkpoint(Net(d=64, layers=4), 1.0)
    args, _ = net_batch(seq=64)
    for _ in range(2):
        model(*args).backward()
        model.zero_grad(set_to_none=True)
    entry = rt.controller(model).entry()
    profile, static = entry.profile, entry.static_bytes
    before = plan_step(profile, static, 0.6, bandwidth=None, time_limit=2)
    workspace = 1 << 20  # more than any activation of this step
    matmuls = {op.index for op in profile.ops
               if op.phase == "forward" and op.name in ("aten::mm", "aten::addmm")}
    assert matmuls
    for i in matmuls:
        profile.ops[i].workspace = workspace
    graph = rt.controller(model).graph()
    nodes = {graph.op_node[i] for i in matmuls}
    assert plan_step(profile, static, 1.0, bandwidth=None, time_limit=2).keeps_everything
    plan = plan_step(profile, static, 0.6, bandwidth=None, time_limit=2)
    assert plan.budget_bytes > before.budget_bytes  # the unplanned peak grew by it
    assert plan.predicted_peak <= plan.budget_bytes
    computes = [i for i, (how, node) in enumerate(plan.steps)
                if how == "compute" and node in nodes]
    assert len(computes) > len(nodes), "no matmul is replayed: the case tests nothing"
    after: dict[int, int] = {}
    for step, _, live in plan.report["timeline"]:
        after[step] = live
    live, expected = static, max(b for _, _, b in plan.report["timeline"])
    for i in range(len(plan.steps)):
        live = after.get(i, live)
        if i in computes:
            expected = max(expected, live + workspace)
    assert plan.predicted_peak == expected


@pytest.mark.parametrize("readable", [True, False])
def test_cuda_op_times_come_from_events_read_after_the_backward(monkeypatch, readable):
    """The profiler's CUDA branch (profile note 5), run on a CPU with torch.cuda's events
    and memory counters replaced by fakes: each op's time is what its two events report
    (longer here than any op's host time), read once the backward is done (no
    synchronization per op); where the events cannot be read, the host's times stay. (The
    real device path runs in test_auto_cuda.py.)"""
    from remat.torch._eager_profile import Profiler, release_outside_modes

    clock = [0.0]
    synced = []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self, stream=None):
            clock[0] += 1000.0  # milliseconds: every op "runs" a second on the device
            self.at = clock[0]

        def elapsed_time(self, end):
            if not readable:
                raise RuntimeError("event not ready")
            assert synced, "events read before the device was synchronized"
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    torch.manual_seed(0)
    model = Net(d=16, layers=2)
    (ids, labels), _ = net_batch(seq=8)
    done = []
    profiler = Profiler(model, torch.device("cpu"), lambda: synced.append(True))
    profiler.cuda = True
    profiler.on_complete = done.append
    profiler.begin_forward()
    with torch.autograd.graph.saved_tensors_hooks(profiler.pack, profiler.unpack):
        loss = model(ids, labels)
    profiler.end_forward(loss)
    loss.backward()
    (profile,) = done
    seconds = [op.seconds for op in profile.ops]
    assert len(seconds) > 20 and profile.forward_ops < len(seconds)
    release_outside_modes(force=True)  # the profiler's mode past the forward (module notes)
    if readable:
        assert seconds == [1.0] * len(seconds)
    else:
        assert all(s < 1.0 for s in seconds)  # the host's clock: microseconds here


def test_storage_tracker_agrees_with_torch_profiler():
    torch.manual_seed(0)
    model = Net(d=64)
    (ids, labels), _ = net_batch(seq=64)

    def step():
        model(ids, labels).backward()
        model.zero_grad(set_to_none=True)

    step()
    with rt.StorageTracker() as tracker:
        step()
    assert tracker.peak_bytes == rt.peak_from_profiler(step)


def test_batchnorm_and_inplace_relu_identical():
    c = compare(ConvNet, [conv_batch()], 0.8)
    assert c.plan.count("recompute") > 0


def test_autocast_bf16_identical():
    c = compare(Net, [net_batch()], 0.6, autocast=True)
    assert c.plan.count("recompute") > 0


def test_new_shape_is_profiled_again_and_stays_identical():
    batches = [net_batch(0, seq=64), net_batch(1, seq=48), net_batch(2, seq=64)]
    c = compare(Net, batches, 0.6, steps=5)
    assert len(c.entries) == 2


def test_eval_and_no_grad_run_unhooked():
    torch.manual_seed(0)
    model = rt.auto_checkpoint(Net(), 0.3)
    (ids, labels), _ = net_batch()
    with torch.no_grad():
        model(ids, labels)
    model.eval()
    model(ids, labels)
    assert not rt.controller(model).entries


def test_same_parameters_and_state_dict_keys():
    torch.manual_seed(0)
    base = Net()
    keys = list(base.state_dict())
    model = rt.auto_checkpoint(base, "1MiB")
    assert model is base
    assert list(model.state_dict()) == keys


class Branchy(torch.nn.Module):
    """Data-dependent control flow: which op runs depends on the input's values."""

    def __init__(self, layers=6):
        super().__init__()
        self.a = torch.nn.Linear(16, 64)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(layers))
        self.c = torch.nn.Linear(64, 1)

    def forward(self, x):
        h = self.a(x)
        if bool(x.sum() > 0):
            h = torch.tanh(h)
        else:
            h = torch.sigmoid(h)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.c(h).square().mean()


def test_divergence_never_gives_other_gradients():
    torch.manual_seed(0)
    base = Branchy()
    x_pos = torch.randn(512, 16).abs()
    x_neg = -x_pos
    model = rt.auto_checkpoint(copy.deepcopy(base), 0.8)
    ref = copy.deepcopy(base)
    for x in (x_pos, x_pos, x_neg, x_neg):
        ref.zero_grad()
        ref(x).backward()
        model.zero_grad()
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            try:
                model(x).backward()
            except rt.StepDivergedError as error:
                assert error.module and error.op
                continue
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), n
    # The diverging input was profiled again.
    assert rt.controller(model).reprofiles >= 1


class ScaledBlock(torch.nn.Module):
    """A block whose hidden activation is scaled by a plain Python float attribute."""

    def __init__(self, d):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)
        self.scale = 1.0

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)) * self.scale)


def test_a_changed_constant_is_replayed_as_it_ran():
    """A rebuild replays each op with the constants this forward passed it, not the
    profiled ones: a scale set between steps gives eager's gradients, without a new
    profile."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(*(ScaledBlock(32) for _ in range(4)))
    x = torch.randn(256, 32)
    model = rt.auto_checkpoint(copy.deepcopy(base), 0.5)
    ref = copy.deepcopy(base)
    for step in range(4):
        if step == 2:
            for m in (*model, *ref):
                m.scale = 0.5
        ref.zero_grad()
        ref(x).square().mean().backward()
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no divergence
            model(x).square().mean().backward()
        if step == 1:
            assert rt.controller(model).plan.count("recompute") > 0
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), (step, n)
    assert rt.controller(model).reprofiles == 0


class Scan(torch.nn.Module):
    """A recurrence over time steps that reads its input one step at a time, as Mamba's
    reference scan does: each ``x[:, t]``'s gradient is a full-size tensor, and autograd
    sums them (three at a time here, as steps read the same slice) between nodes."""

    def __init__(self, d=32, steps=24):
        super().__init__()
        self.proj = torch.nn.Linear(d, d)
        self.mix = torch.nn.Linear(d, d)
        self.steps = steps

    def forward(self, x):
        u = self.proj(x)
        h = torch.zeros_like(u[:, 0])
        outs = []
        for t in range(self.steps):
            h = torch.tanh(self.mix(h) + u[:, t] * u[:, t].sigmoid())
            outs.append(h)
        return torch.stack(outs, 1).square().mean()


def test_gradient_sums_between_nodes_are_predicted():
    """Autograd's sums of gradients are made between nodes; the profile sees them where
    they are made (the mode stays on for each node's evaluation), so the unplanned step is
    predicted to the byte and a plan within its prediction."""
    torch.manual_seed(0)
    model = rt.auto_checkpoint(Scan(), 0.8)
    x = torch.randn(16, 24, 32)
    for _ in range(2):
        model(x).backward()
        model.zero_grad(set_to_none=True)
    entry = rt.controller(model).entry()
    with rt.StorageTracker() as planned:
        model(x).backward()
    model.zero_grad(set_to_none=True)
    rt.controller(model).enabled = False
    with rt.StorageTracker() as unplanned:
        model(x).backward()
    unplanned_predicted = (entry.plan.unplanned or entry.plan.report)["peak_bytes"]
    assert unplanned.peak_bytes + entry.static_bytes == unplanned_predicted
    assert planned.peak_bytes + entry.static_bytes <= entry.plan.predicted_peak
    assert entry.plan.count("recompute") > 0


def test_cpu_plan_offloads_to_a_store_identically(tmp_path):
    """On CPU a plan offloads only to a store the caller names: every offloaded saved tensor
    (dropout masks among them, filled in place after they are made) goes to a file and comes
    back as it was; losses, gradients and state equal eager's, the peak is within the
    prediction, and no file is left."""
    torch.manual_seed(0)
    base = Net(d=64, layers=4)
    batches = [net_batch(0, seq=128)]
    eager = train(copy.deepcopy(base), batches)
    model = rt.auto_checkpoint(copy.deepcopy(base), 0.5, store=tmp_path, bandwidth="100GB/s")
    planned = train(model, batches)
    assert_identical(eager, planned)
    plan = rt.controller(model).plan
    assert plan.count("offload") > 0, rt.controller(model).table()
    assert list(tmp_path.iterdir()) == []
    (args, kwargs), = batches
    with rt.StorageTracker() as tracker:
        model(*args, **kwargs).backward()
    assert tracker.peak_bytes + rt.controller(model).entry().static_bytes <= plan.predicted_peak
    assert list(tmp_path.iterdir()) == []


def train_under(tmp_path, layers, make_plan):
    """Trains a ``Net`` for three AdamW steps plain and under ``auto_checkpoint`` with a CPU
    store at a named 1 GB/s link, where the plan ``make_plan(entry)`` returns runs from the
    second step on in place of the planner's choice; asserts the two bit-identical and
    returns the planned model and its batches."""
    from remat.torch._eager_run import RuntimePlan

    torch.manual_seed(0)
    base = Net(d=64, layers=layers)
    batches = [net_batch(0, seq=128)]
    eager = train(copy.deepcopy(base), batches)
    model = rt.auto_checkpoint(copy.deepcopy(base), 1.0, store=tmp_path, bandwidth="1GB/s")
    control = rt.controller(model)

    def install(entry):
        entry.plan = make_plan(entry)
        entry.runtime = RuntimePlan(entry.profile, entry.plan, torch.device("cpu"),
                                    control.store)

    control._plan = install
    try:
        assert_identical(eager, train(model, batches))
    finally:
        del control._plan
    return model, batches


@pytest.mark.parametrize("depth", [2, 3])
def test_rebuilds_read_offloaded_anchors_identically(tmp_path, depth):
    """Each block (depth 2) or each block's module (depth 3) rebuilt from an input that went
    to the store (the plan's note 7: the module-segment family with its anchors offloaded):
    every rebuild fetches its anchor back, the step equals eager's over three AdamW steps,
    the measured peak is within the prediction, and offloading the anchors lowers it."""
    from remat.torch import _eager_plan as ep, _eager_segments as segments

    planned = {}

    def install(entry):
        sg = ep.StepGraph(entry.profile, entry.static_bytes)
        whole = sg.graph.store_all_peak
        parts = [s for s in segments._segments_at(entry.profile, depth) if s]
        kept = segments._evaluate_segments(sg, parts, set(), 1e9, whole, whole, depth)
        plan = segments._offload_anchors(sg, kept, 1e9, whole, whole)
        assert plan is not None
        plan.unplanned = kept.report
        planned.update(kept=kept, plan=plan)
        return plan

    model, batches = train_under(tmp_path, 4, install)
    c = rt.controller(model)
    plan, kept = planned["plan"], planned["kept"]
    offloaded = {v for v, d in plan.decisions.items() if d == "offload"}
    assert offloaded and offloaded <= plan.anchors, (offloaded, plan.anchors)
    # Inside the blocks the anchors are what stays across the backward: offloading them
    # lowers the peak; whole blocks peak elsewhere.
    assert (plan.predicted_peak < kept.predicted_peak if depth == 3
            else plan.predicted_peak <= kept.predicted_peak)
    (args, kwargs), = batches
    with rt.StorageTracker() as tracker:
        model(*args, **kwargs).backward()
    entry = c.entry()
    assert entry.plan is plan
    assert tracker.peak_bytes + entry.static_bytes <= plan.predicted_peak
    assert list(tmp_path.iterdir()) == []


def test_a_proposal_that_rebuilds_from_a_swapped_tensor_reads_it_offloaded(tmp_path):
    """A planner proposal that swaps a block's fc1 output and rebuilds the GELU after it
    from that copy: the fc1 output is an offloaded anchor (note 7), the GELU's recipe stops
    at it (no matmul replayed, the copy fetched by the rebuild ahead of its own prefetch),
    and the plan runs bit-identical to eager within its predicted peak."""
    import types

    from remat.torch import _eager_plan as ep

    chosen = {}

    def install(entry):
        profile = entry.profile
        sg = ep.StepGraph(profile, entry.static_bytes)
        values = profile.values
        gelu = next(op for op in profile.ops[:profile.forward_ops] if op.name == "aten::gelu")
        fc1 = next(r.value for r in gelu.leaves if hasattr(r, "value") and r.value >= 0)
        out = gelu.new_values[0]
        assert values[fc1].saved and values[out].saved
        decisions = [{"kind": "keep"} for _ in range(sg.num_nodes)]
        decisions[sg.node_of(fc1)] = {"kind": "swap"}
        decisions[sg.node_of(out)] = {"kind": "recompute", "from": [sg.node_of(fc1)]}
        proposal = types.SimpleNamespace(decisions=decisions, strategy="by hand")
        whole = sg.graph.store_all_peak
        plan = ep._from_proposal(sg, proposal, 1e9, whole, whole)
        plan.unplanned = plan.report
        chosen.update(plan=plan, fc1=fc1, out=out, matmul=values[fc1].op)
        return plan

    model, batches = train_under(tmp_path, 2, install)
    c = rt.controller(model)
    plan = chosen["plan"]
    assert plan.decisions[chosen["fc1"]] == "offload"
    assert chosen["fc1"] in plan.anchors
    assert plan.decisions[chosen["out"]] == "recompute"
    assert chosen["matmul"] not in plan.recipes[chosen["out"]].ops
    (args, kwargs), = batches
    with rt.StorageTracker() as tracker:
        model(*args, **kwargs).backward()
    assert tracker.peak_bytes + c.entry().static_bytes <= plan.predicted_peak
    assert list(tmp_path.iterdir()) == []


def test_cpu_plans_recompute_only_without_a_store():
    torch.manual_seed(0)
    model = rt.auto_checkpoint(Net(d=64, layers=4), 0.5, bandwidth="100GB/s")
    (args, kwargs), = [net_batch(0, seq=128)]
    for _ in range(2):
        model(*args, **kwargs).backward()
    assert rt.controller(model).plan.count("offload") == 0


def test_store_errors_name_the_store_and_the_file(tmp_path):
    with pytest.raises(remat.ArgumentError, match="store .* is not a directory"):
        rt.auto_checkpoint(Net(), 0.5, store=tmp_path / "missing")
    store = tmp_path / "store"
    store.mkdir()
    torch.manual_seed(0)
    model = rt.auto_checkpoint(Net(d=64, layers=4), 0.5, store=store, bandwidth="100GB/s")
    (args, kwargs), = [net_batch(0, seq=128)]
    for _ in range(2):
        model(*args, **kwargs).backward()
    assert rt.controller(model).plan.count("offload") > 0
    store.rmdir()  # the next step's writes fail: its backward says where
    with pytest.raises(rt.StoreError, match=str(store)) as info:
        model(*args, **kwargs).backward()
    assert info.value.step == "write" and info.value.path.startswith(str(store))


def test_budget_errors_name_the_budget():
    with pytest.raises(remat.ArgumentError, match="memory_budget"):
        rt.auto_checkpoint(Net(), 1.5)
    with pytest.raises(remat.ArgumentError):
        rt.auto_checkpoint(Net(), [1])
    # Text is read when it is given, and the error names the argument, not another one.
    with pytest.raises(remat.ArgumentError, match=r"^memory_budget 12 parsecs: unknown unit"):
        rt.auto_checkpoint(Net(), "12 parsecs")
    with pytest.raises(remat.ArgumentError, match="memory_budget 0B: comes to 0 bytes"):
        rt.auto_checkpoint(Net(), "0B")
    # Bytes under 1 KiB cannot be meant: refused when given, not at the second step.
    with pytest.raises(remat.ArgumentError, match="memory_budget 1000: 1000 bytes cannot hold"):
        rt.auto_checkpoint(Net(), 1000)
    assert rt.controller(rt.auto_checkpoint(Net(), "2 GiB")).memory_budget == "2 GiB"
    torch.manual_seed(0)
    model = rt.auto_checkpoint(Net(), 4096)  # bytes: below anything reachable
    (ids, labels), _ = net_batch()
    model(ids, labels).backward()
    with pytest.raises(remat.BudgetError, match="least peak"):
        model(ids, labels)


def test_table_names_modules():
    torch.manual_seed(0)
    model = rt.auto_checkpoint(Net(), 0.6)
    (ids, labels), _ = net_batch()
    for _ in range(2):
        model(ids, labels).backward()
    table = rt.controller(model).table()
    assert "blocks.0" in table and "predicted peak" in table


def test_plot_draws_the_planned_and_unplanned_timelines(tmp_path):
    torch.manual_seed(0)
    model = rt.auto_checkpoint(Net(), 0.6)
    (ids, labels), _ = net_batch()
    for _ in range(2):
        model(ids, labels).backward()
    c = rt.controller(model)
    c.plot(tmp_path / "memory.svg")
    svg = (tmp_path / "memory.svg").read_text()
    assert "unplanned" in svg and "budget" in svg and "remat" in svg
    with pytest.raises(remat.ArgumentError, match="svg or .png"):
        c.plot(tmp_path / "memory.txt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory.svg"]


def test_checkpointed_modules_identical_and_within_predicted():
    """A plan of checkpoint's family (each block rebuilt from its input, nothing kept inside
    it) runs as torch.utils.checkpoint around the blocks, with no dispatch mode: still the
    bits of eager over several AdamW steps, the measured peak within the predicted one."""
    torch.manual_seed(0)
    base = Net(d=64, layers=6)
    batch = net_batch(seq=64)
    eager = train(copy.deepcopy(base), [batch])
    model = rt.auto_checkpoint(copy.deepcopy(base), 0.7, strategy="checkpoint")
    planned = train(model, [batch])
    assert_identical(eager, planned)
    plan = rt.controller(model).plan
    assert plan.checkpoint_modules and plan.strategy.startswith("checkpoint:"), plan.strategy
    assert all(name.startswith("blocks.") for name in plan.checkpoint_modules)
    peak, _ = measured_peak(model, batch)
    assert peak <= plan.predicted_peak <= plan.budget_bytes
    with pytest.raises(remat.BudgetError, match="checkpointed modules"):
        tight = rt.auto_checkpoint(copy.deepcopy(base), 0.05, strategy="checkpoint")
        train(tight, [batch], steps=2)
