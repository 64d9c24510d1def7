"""remat.torch: capture, plans run in PyTorch, swaps through the file store, SAC export.

Every model here is tiny (CPU, one thread) so the file runs in well under a minute.
"""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")

import remat  # noqa: E402
import remat.torch as rt  # noqa: E402

F = torch.nn.functional


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Block(torch.nn.Module):
    def __init__(self, d, p):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, 2 * d)
        self.fc2 = torch.nn.Linear(2 * d, d)
        self.drop = torch.nn.Dropout(p)
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x):
        h = self.drop(F.gelu(self.fc1(self.norm(x))))
        return x + self.fc2(h)


class MLP(torch.nn.Module):
    def __init__(self, d=64, layers=4, p=0.0):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d, p) for _ in range(layers))
        self.head = torch.nn.Linear(d, 10)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def mlp_loss(model, x, y):
    return F.cross_entropy(model(x), y)


def mlp_case(p=0.0, seed=0):
    torch.manual_seed(seed)
    model = MLP(p=p)
    x = torch.randn(256, 64)
    y = torch.randint(0, 10, (256,))
    return model, (x, y)


def budget(captured, fraction):
    """Static bytes plus a fraction of the store-all activation bytes."""
    static = captured.static_bytes
    return static + int(fraction * (captured.store_all_peak() - static))


def run(step, inputs, seed=1):
    torch.manual_seed(seed)
    loss, grads = step(*inputs)
    return loss, grads


def assert_same(g0, g1):
    assert g0.keys() == g1.keys()
    for k in g0:
        assert torch.equal(g0[k], g1[k]), f"gradient of {k} differs"


# ---- capture --------------------------------------------------------------------------------


def test_capture_graph_json_loads_in_remat(tmp_path):
    model, inputs = mlp_case()
    captured = rt.capture(model, inputs, loss_fn=mlp_loss, runs=2)
    path = tmp_path / "g.json"
    captured.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "remat-graph" and data["time_unit_s"] == 1e-6
    assert data["nodes"][-1]["name"] == "end:step"
    params = sum(p.numel() * 4 for p in model.parameters())
    inputs_bytes = sum(t.numel() * t.element_size() for t in inputs)
    assert data["static_bytes"] == params + inputs_bytes
    graph = remat.load_graph(path)
    assert graph.num_nodes == captured.num_nodes
    assert graph.store_all_peak == captured.store_all_peak()
    assert not [p.name for p in tmp_path.iterdir() if p.name != "g.json"], "temp file left"


def test_views_have_no_bytes_and_keep_their_root():
    model, inputs = mlp_case()
    captured = rt.capture(model, inputs, loss_fn=mlp_loss, runs=1)
    views = [n for n in captured.nodes if n.is_view]
    assert views, "the MLP's transposes and reshapes are views"
    for v in views:
        assert v.output_bytes == 0
    # A reader of a view also reads the view's storage root.
    for n in captured.nodes:
        for j in n.inputs:
            for r in captured.nodes[j].roots:
                assert r in n.inputs, f"{n.name} reads view {captured.nodes[j].name}"
    # Every backward node comes after the forward ones, and the loss op is backward.
    phases = [n.phase for n in captured.nodes]
    assert phases == sorted(phases, key=lambda p: p == "backward")
    loss_op = captured.nodes[captured.loss_index].name
    assert "nll_loss" in loss_op


def test_multi_output_op_counts_each_output():
    model, inputs = mlp_case()
    captured = rt.capture(model, inputs, loss_fn=mlp_loss, runs=1)
    ln = next(i for i, n in enumerate(captured.nodes) if "native_layer_norm" == n.name)
    getitems = [i for i, n in enumerate(captured.nodes) if ln in n.inputs
                and n.fx.target.__name__ == "getitem"]
    assert len(getitems) == 3  # output, mean, rstd
    out = captured.nodes[getitems[0]]
    assert out.output_bytes == 256 * 64 * 4
    assert captured.nodes[ln].output_bytes == sum(captured.nodes[g].output_bytes
                                                  for g in getitems)


def test_dropout_nodes_are_marked_random():
    model, inputs = mlp_case(p=0.3)
    captured = rt.capture(model, inputs, loss_fn=mlp_loss, runs=1)
    assert sum(n.is_random for n in captured.nodes) == 4
    # Random ops draw from one stream in node order: the graph tells the planner to keep
    # that order, and no plan of it reorders.
    assert json.loads(captured.to_json())["fixed_order"] is True
    for fraction in (0.6, 0.3):
        try:
            plan = remat.plan(captured, budget(captured, fraction))
        except remat.BudgetError:
            continue
        assert not plan.reorders


def test_a_step_without_random_ops_may_be_reordered_and_stays_exact():
    model, inputs = mlp_case(p=0.0)
    captured = rt.capture(model, inputs, loss_fn=mlp_loss, runs=1)
    assert "fixed_order" not in json.loads(captured.to_json())
    _, reference = run(rt.apply(captured), inputs)
    for fraction in (0.7, 0.4):
        try:
            plan = remat.plan(captured, budget(captured, fraction), strategy="anytime")
        except remat.BudgetError:
            continue
        step = rt.apply(captured, plan)
        _, grads = run(step, inputs)
        assert_same(reference, grads)
        assert step.stats.peak_total_bytes <= plan.peak_bytes


def test_inplace_ops_are_functionalized_and_buffers_untouched():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(inplace=True),
        torch.nn.Conv2d(8, 8, 3), torch.nn.ReLU(inplace=True), torch.nn.Flatten(),
        torch.nn.Linear(8 * 12 * 12, 10))
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    captured = rt.capture(model, (x, y), loss_fn=mlp_loss, runs=1)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"capture changed {k}"
    targets = {n.fx.target for n in captured.nodes if n.fx is not None}
    assert torch.ops.aten.relu_.default not in targets
    step = rt.apply(captured)
    _, grads = run(step, (x, y))
    model.zero_grad()
    mlp_loss(model, x, y).backward()
    for k, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[k], atol=1e-5), k
    # The step updates running statistics once, as the eager step did.
    assert int(model[1].num_batches_tracked) == 2


def test_data_dependent_control_flow_names_the_module():
    class Gate(torch.nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Gate())
    with pytest.raises(rt.CaptureError) as info:
        rt.capture(model, (torch.randn(2, 4),), loss_fn=lambda m, x: m(x).sum())
    assert "`1`" in str(info.value) and "data-dependent" in str(info.value)
    assert info.value.module == "1"
    assert isinstance(info.value, remat.RematError)


def test_non_scalar_loss_is_refused():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(rt.CaptureError, match="scalar"):
        rt.capture(model, (torch.randn(2, 4),))


def test_wrong_input_shape_is_named():
    model, inputs = mlp_case()
    captured = rt.capture(model, inputs, loss_fn=mlp_loss, runs=1)
    step = rt.apply(captured)
    with pytest.raises(rt.CaptureError, match="shape"):
        step(torch.randn(3, 64), inputs[1])


# ---- running plans ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dropout_mlp():
    model, inputs = mlp_case(p=0.25)
    return model, inputs, rt.capture(model, inputs, loss_fn=mlp_loss, runs=2)


def test_keep_everything_matches_eager_and_its_simulated_peak(dropout_mlp):
    model, inputs, captured = dropout_mlp
    step = rt.apply(captured)
    loss, grads = run(step, inputs, seed=3)
    assert step.stats.peak_total_bytes == captured.store_all_peak()
    assert step.stats.recomputes == 0
    # Eager autograd with the same generator draws the same dropout masks.
    model.zero_grad()
    torch.manual_seed(3)
    eager = mlp_loss(model, *inputs)
    eager.backward()
    assert torch.allclose(loss, eager)
    for k, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[k], rtol=1e-5, atol=1e-6), k
    step.set_grads(grads)  # accumulates onto the eager gradients
    for k, p in model.named_parameters():
        assert torch.allclose(p.grad, 2 * grads[k], rtol=1e-5, atol=1e-6), k


@pytest.mark.parametrize("strategy", [None, "chen-greedy", "recompute-all"])
def test_plans_give_identical_gradients_with_dropout_and_fit(dropout_mlp, strategy):
    _, inputs, captured = dropout_mlp
    _, reference = run(rt.apply(captured), inputs)
    measured = []
    for fraction in (0.8, 0.6, 0.45, 0.3):
        try:
            plan = remat.plan(captured, budget(captured, fraction), strategy=strategy)
        except remat.BudgetError:
            continue
        step = rt.apply(captured, plan)
        loss, grads = run(step, inputs)
        assert_same(reference, grads)
        assert step.stats.peak_total_bytes <= plan.peak_bytes
        assert rt.simulated_peak(captured, step.steps) == plan.peak_bytes
        measured.append((fraction, step.stats.peak_total_bytes,
                         step.stats.recomputes + step.stats.swaps_out))
    assert len(measured) >= 2, measured
    assert any(r > 0 for _, _, r in measured), "no plan recomputed or swapped anything"
    # A smaller budget never gives a larger measured peak.
    peaks = [p for _, p, _ in measured]
    assert peaks == sorted(peaks, reverse=True), measured


def test_recompute_replays_dropout_and_leaves_generator_as_without_plan(dropout_mlp):
    _, inputs, captured = dropout_mlp
    plan = remat.plan(captured, budget(captured, 0.9), strategy="recompute-all")
    step = rt.apply(captured, plan)
    random_recomputed = [
        i for op, i in step.steps if op == "compute" and captured.nodes[i].is_random
    ]
    assert len(random_recomputed) > len(set(random_recomputed)), "no dropout recomputed"
    run(step, inputs)
    after_plan = torch.rand(4)
    run(rt.apply(captured), inputs)
    after_keep = torch.rand(4)
    assert torch.equal(after_plan, after_keep)


def test_swaps_go_through_the_file_store_with_identical_gradients(dropout_mlp, tmp_path):
    _, inputs, captured = dropout_mlp
    _, reference = run(rt.apply(captured), inputs)
    # A slow link makes MuTWO weigh swaps against recomputes; a tight budget forces some.
    plan = None
    for fraction in (0.6, 0.5, 0.4):
        candidate = remat.plan(captured, budget(captured, fraction), strategy="mutwo",
                               bandwidth=2e9)
        if any(op == "swap_out" for op, _ in candidate.steps):
            plan = candidate
            break
    assert plan is not None, "mutwo swapped nothing"
    store = rt.FileStore(tmp_path)
    step = rt.apply(captured, plan, store=store)
    written = []
    original = store._write

    def spy(raw, paths):
        original(raw, paths)
        written.extend(os.path.getsize(p) for p in paths)

    store._write = spy
    _, grads = run(step, inputs)
    assert_same(reference, grads)
    assert step.stats.swaps_out > 0 and step.stats.swaps_in > 0
    assert sum(written) == store.bytes_out > 0
    assert step.stats.peak_total_bytes <= plan.peak_bytes
    assert not os.listdir(store.directory), "swap files left after the step"
    store.close()
    assert not os.path.exists(store.directory)


def test_plan_file_from_the_cli_format_runs(dropout_mlp, tmp_path):
    _, inputs, captured = dropout_mlp
    _, reference = run(rt.apply(captured), inputs)
    plan = remat.plan(captured, budget(captured, 0.5), strategy="chen-greedy")
    path = tmp_path / "plan.json"
    plan.save(path)
    assert json.loads(path.read_text())["steps"][0]["op"] == "compute"
    for given in (path, str(path), path.read_text()):
        _, grads = run(rt.apply(captured, given), inputs)
        assert_same(reference, grads)


def test_plan_for_another_graph_is_refused(dropout_mlp):
    _, _, captured = dropout_mlp
    with pytest.raises(rt.ScheduleError, match="nodes"):
        rt.apply(captured, {"node_count": 3, "steps": [], "decisions": []})


def test_plan_reading_a_freed_tensor_is_refused(dropout_mlp):
    _, inputs, captured = dropout_mlp
    steps = rt.keep_everything_steps(captured)
    # Free the first owned forward tensor right after computing it.
    first = next(i for i, n in enumerate(captured.nodes) if n.output_bytes and n.inputs == [])
    victim = next(i for i, n in enumerate(captured.nodes) if n.output_bytes and not n.is_view
                  and any(i in m.inputs for m in captured.nodes))
    k = steps.index(("compute", victim))
    steps.insert(k + 1, ("free", victim))
    step = rt.apply(captured, {"steps": [{"op": op, "node": i} for op, i in steps]})
    with pytest.raises(rt.ScheduleError, match="not on the device"):
        run(step, inputs)
    del first


# ---- Hugging Face model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attention_dropout=0.1)
    model = transformers.LlamaForCausalLM(config)
    model.train()
    ids = torch.randint(0, 128, (2, 32))
    inputs = {"input_ids": ids, "labels": ids}
    return model, inputs, rt.capture(model, inputs, runs=1)


def test_llama_plans_identical_and_within_peak(tiny_llama):
    model, inputs, captured = tiny_llama
    torch.manual_seed(5)
    loss0, reference = rt.apply(captured)(**inputs)
    model.zero_grad()
    torch.manual_seed(5)
    eager = model(**inputs).loss
    eager.backward()
    assert torch.allclose(loss0, eager, atol=1e-6)
    for k, p in model.named_parameters():
        assert torch.allclose(p.grad, reference[k], rtol=1e-4, atol=1e-6), k
    peaks = []
    for fraction in (0.8, 0.6, 0.45, 0.3):
        try:
            plan = remat.plan(captured, budget(captured, fraction))
        except remat.BudgetError:
            continue
        step = rt.apply(captured, plan)
        torch.manual_seed(5)
        _, grads = step(**inputs)
        assert_same(reference, grads)
        assert step.stats.peak_total_bytes <= plan.peak_bytes
        peaks.append(step.stats.peak_total_bytes)
    assert len(peaks) >= 2
    assert peaks == sorted(peaks, reverse=True)


def test_gpt2_dropout_replayed_in_recomputes():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                     n_positions=64)  # dropouts 0.1 by default
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 128, (2, 32))
    captured = rt.capture(model, (ids,), loss_fn=lambda m, x: m(input_ids=x, labels=x).loss,
                          runs=1)
    assert sum(n.is_random for n in captured.nodes) >= 7  # embd, 2 x (attn, resid x 2)
    torch.manual_seed(9)
    _, reference = rt.apply(captured)(ids)
    plan = remat.plan(captured, budget(captured, 0.6), strategy="chen-greedy")
    step = rt.apply(captured, plan)
    torch.manual_seed(9)
    _, grads = step(ids)
    assert_same(reference, grads)
    recomputed = [i for op, i in step.steps if op == "compute"]
    random_twice = [i for i in set(recomputed) if captured.nodes[i].is_random
                    and recomputed.count(i) > 1]
    assert random_twice, "no dropout recomputed"
    assert step.stats.peak_total_bytes <= plan.peak_bytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pinned_store_and_rng_replay():
    model, (x, y) = mlp_case(p=0.25)
    model = model.cuda()
    inputs = (x.cuda(), y.cuda())
    captured = rt.capture(model, inputs, loss_fn=mlp_loss, runs=1)
    _, reference = run(rt.apply(captured), inputs)
    plan = remat.plan(captured, budget(captured, 0.5), strategy="mutwo", bandwidth=2e9)
    step = rt.apply(captured, plan)
    assert isinstance(step.store, rt.PinnedStore) or step.store is None
    _, grads = run(step, inputs)
    assert_same(reference, grads)
    assert step.stats.peak_total_bytes <= plan.peak_bytes


# ---- selective activation checkpointing -------------------------------------------------------


def _saved_bytes(fn):
    """Bytes of the storages made during ``fn()`` that are still alive after it returns
    (what autograd or the checkpoint cache keeps for the backward), counted by storage."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode

    made = {}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    s = t.untyped_storage()
                    made.setdefault(s.data_ptr(), (StorageWeakRef(s), s.nbytes()))
            return out

    with Record():
        result = fn()
    alive = sum(n for ref, n in made.values() if not ref.expired())
    return result, alive


def test_sac_policy_gives_same_grads_and_saves_less(dropout_mlp):
    from torch.utils.checkpoint import checkpoint

    model, inputs, captured = dropout_mlp
    model.eval()  # no dropout: SAC and the plain step compare bit for bit
    try:
        cap = rt.capture(model, inputs, loss_fn=mlp_loss, runs=1)
        plan = remat.plan(cap, budget(cap, 0.5), strategy="chen-greedy")
        policy = rt.selective_checkpoint_policy(cap, plan)
        counts = [policy.counts(f"blocks.{i}") for i in range(4)]
        assert sum(c["save"] for c in counts) and sum(c["recompute"] for c in counts)

        def forward(use_policy):
            x, y = inputs
            for i, block in enumerate(model.blocks):
                if use_policy:
                    x = checkpoint(block, x, use_reentrant=False,
                                   context_fn=policy.context_fn(f"blocks.{i}"))
                else:
                    x = block(x)
            return F.cross_entropy(model.head(x), y)

        grads = []
        saved = []
        for use_policy in (False, True):
            model.zero_grad()
            loss, alive = _saved_bytes(lambda: forward(use_policy))
            loss.backward()
            saved.append(alive)
            grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        assert_same(grads[0], grads[1])
        assert saved[1] < saved[0], saved
    finally:
        model.train()
