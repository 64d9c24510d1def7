"""remat.torch.capture: a training step traced and profiled as remat's graph (what
``remat plan`` reads). Plans run in PyTorch through ``auto_checkpoint`` (test_auto.py).

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


def test_a_step_without_random_ops_may_be_reordered():
    model, inputs = mlp_case(p=0.0)
    captured = rt.capture(model, inputs, loss_fn=mlp_loss, runs=1)
    assert "fixed_order" not in json.loads(captured.to_json())
    plan = remat.plan(captured, budget(captured, 0.7), strategy="anytime")
    assert plan.peak_bytes <= plan.budget_bytes


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
