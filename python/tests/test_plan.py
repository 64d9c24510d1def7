"""remat.plan / remat.Graph through the Rust planner: every strategy, every budget form,
the report values, saving, and the same numbers as the `remat plan` command."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess

import pytest

import remat
from remat_test_graphs import chain_graph, write_chain

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture()
def graph_path(tmp_path):
    return write_chain(tmp_path / "chain.json")


def check_schedule(graph: remat.Graph, p: remat.Plan) -> None:
    """The plan's schedule is one the simulator accepts as remat's plan format says:
    every node computed, inputs present at each compute, decisions for every tensor."""
    on_device = set()
    computed = set()
    inputs = [n["inputs"] for n in graph.nodes()]
    for op, node in p.steps:
        assert op in ("compute", "free", "swap_out", "swap_in"), op
        assert 0 <= node < graph.num_nodes
        if op == "compute":
            missing = [i for i in inputs[node] if i not in on_device]
            assert not missing, f"compute {node} without inputs {missing}"
            on_device.add(node)
            computed.add(node)
        elif op == "free":
            on_device.remove(node)
        elif op == "swap_in":
            on_device.add(node)
    assert computed == set(range(graph.num_nodes))
    assert len(p.decisions) == graph.num_nodes
    assert {d["kind"] for d in p.decisions} <= {"keep", "swap", "recompute"}


def test_every_strategy_by_name_plans_within_the_budget(graph_path):
    g = remat.load_graph(graph_path)
    names = remat.strategies()
    assert "store-all" in names and "mutwo" in names and len(names) == len(set(names))
    for name in names:
        p = remat.plan(g, 1.0, strategy=name)
        assert p.strategy == name
        assert p.budget_bytes == g.store_all_peak
        assert g.memory_floor <= p.peak_bytes <= p.budget_bytes, name
        assert p.store_all_peak == g.store_all_peak
        check_schedule(g, p)
        assert p.compute_time == pytest.approx(g.base_time)
        assert p.total_time >= p.compute_time
        expected = (p.total_time - p.compute_time) / p.compute_time
        assert p.overhead == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_parameterized_strategies_are_taken_by_name(graph_path):
    p = remat.plan(graph_path, 1.0, strategy="every:3")
    assert p.strategy == "every:3"


def test_a_named_strategy_stops_at_the_time_limit_given(graph_path):
    g = remat.load_graph(graph_path)
    # Without a limit evict runs to its plan; with one already spent it says so rather
    # than calling a budget that fits infeasible.
    assert remat.plan(g, 0.5, strategy="evict").strategy == "evict"
    with pytest.raises(remat.PlanError, match="out of time") as caught:
        remat.plan(g, 0.5, strategy="evict", time_limit=1e-9)
    assert caught.value.strategy == "evict"


def test_budget_forms_agree(graph_path):
    g = remat.load_graph(graph_path)
    peak = g.store_all_peak
    half = remat.plan(g, 0.5)
    assert half.budget_bytes == peak * 5 // 10
    assert remat.plan(g, "0.5").budget_bytes == half.budget_bytes
    assert remat.plan(g, peak // 2).budget_bytes == peak // 2
    assert remat.plan(g, "6MiB").budget_bytes == 6 << 20
    assert remat.plan(g, "6.5e6").budget_bytes == 6_500_000
    # A float is read as its shortest decimal, exactly like the text.
    assert remat.plan(g, 0.7).budget_bytes == remat.plan(g, "0.7").budget_bytes == peak * 7 // 10


@pytest.mark.parametrize(
    "text, bytes_",
    [("1GB", 10**9), ("1gb", 10**9), ("1GiB", 1 << 30), ("1.5gib", 3 << 29), ("7G", 7 * 10**9)],
)
def test_budget_units_mean_what_they_mean_everywhere(graph_path, text, bytes_):
    # One meaning for every front end: GB is 10^9 bytes, GiB 2^30, units in any case.
    assert remat.plan(graph_path, text).budget_bytes == bytes_


def test_a_smaller_budget_never_gives_a_larger_peak(graph_path):
    g = remat.load_graph(graph_path)
    peaks = [remat.plan(g, f).peak_bytes for f in (1.0, 0.8, 0.6, 0.45)]
    budgets = [int(g.store_all_peak * f) for f in (1.0, 0.8, 0.6, 0.45)]
    for peak, budget in zip(peaks, budgets):
        assert peak <= budget


def test_bandwidth_as_number_or_text(graph_path):
    a = remat.plan(graph_path, 0.5, strategy="mutwo", bandwidth="1GB/s")
    b = remat.plan(graph_path, 0.5, strategy="mutwo", bandwidth=1e9)
    assert a.bandwidth == b.bandwidth == 1e9
    assert a.steps == b.steps and a.total_time == b.total_time


def test_the_graph_may_be_given_in_every_documented_form(graph_path):
    text = pathlib.Path(graph_path).read_text()

    class Captured:
        def to_json(self):
            return text

    forms = [
        remat.load_graph(graph_path),
        graph_path,
        pathlib.Path(graph_path),
        text,
        json.loads(text),
        Captured(),
        remat.Graph.from_json(text),
    ]
    plans = [remat.plan(f, 0.6) for f in forms]
    assert len({(p.strategy, p.peak_bytes, p.total_time, tuple(p.steps)) for p in plans}) == 1


def test_graph_properties_and_json_round_trip(tmp_path):
    data = chain_graph(layers=4, activation_bytes=1000)
    g = remat.Graph.from_json(json.dumps(data))
    assert g.name == "chain" and g.num_nodes == len(g) == 9
    assert g.static_bytes == 4096
    # Store-all peaks when the loss is computed (f0..f3 and the loss): static + 4008.
    assert g.store_all_peak == 4096 + 4 * 1000 + 8
    # The floor: b2 (or b1) with its two inputs, 3000 bytes, plus static.
    assert g.memory_floor == 4096 + 3000
    # Recomputation alone reaches the floor here (nothing pinned), and a graph this small is
    # searched exactly.
    assert g.recompute_floor == g.memory_floor and g.recompute_floor_exact
    assert "recompute floor" in repr(g)
    again = remat.Graph.from_json(g.to_json())
    assert again.to_json() == g.to_json()
    assert [n["name"] for n in g.nodes()][:2] == ["f0", "f1"]
    out = tmp_path / "g.json"
    g.save(out)
    assert remat.load_graph(out).to_json() == g.to_json()
    assert sorted(os.listdir(tmp_path)) == ["g.json"]


def test_networkx_node_link_graphs_load(tmp_path):
    nx = {
        "directed": True,
        "multigraph": False,
        "graph": {"name": "tiny"},
        "nodes": [
            {"id": 0, "name": "a", "cost_cpu": 5, "cost_ram": 100, "backward": False},
            {"id": 1, "name": "b", "cost_cpu": 5, "cost_ram": 100, "backward": False},
            {"id": 2, "name": "c", "cost_cpu": 5, "cost_ram": 100, "backward": True},
        ],
        "links": [{"source": 0, "target": 1}, {"source": 1, "target": 2}, {"source": 0, "target": 2}],
    }
    path = tmp_path / "nx.json"
    path.write_text(json.dumps(nx))
    try:
        g = remat.load_graph(path)
    except remat.GraphError as e:  # the importer names the field it wants
        pytest.fail(f"networkx graph refused: {e}")
    assert g.num_nodes == 3 and g.time_unit_s == 1e-6 and g.base_time == 15.0
    assert remat.load_graph(path, time_unit_s=1e-3).time_unit_s == 1e-3
    # c reads a and b: all three coexist.
    assert g.store_all_peak == g.memory_floor == 300
    assert remat.plan(g, 1.0).peak_bytes == 300


def test_save_writes_the_plan_and_its_timeline_atomically(graph_path, tmp_path):
    p = remat.plan(graph_path, 0.5)
    out = tmp_path / "out"
    out.mkdir()
    p.save(out / "plan.json", plot=out / "plan.svg")
    saved = json.loads((out / "plan.json").read_text())
    assert saved == json.loads(p.to_json())
    assert saved["strategy"] == p.strategy and saved["budget_bytes"] == p.budget_bytes
    assert len(saved["decisions"]) == len(p.decisions)
    assert (out / "plan.svg").read_text().lstrip().startswith("<svg")
    p.plot(out / "t.png")
    assert (out / "t.png").read_bytes()[1:4] == b"PNG"
    assert sorted(os.listdir(out)) == ["plan.json", "plan.svg", "t.png"]


def test_report_lines_and_time_limit(graph_path):
    p = remat.plan(graph_path, 0.5, time_limit=2.5)
    assert p.time_limit == 2.5
    lines = str(p).splitlines()
    assert lines[0] == f"strategy      {p.strategy}"
    assert lines[1].startswith(f"peak          {remat.human_bytes(p.peak_bytes)} (")
    assert lines[2].startswith(f"time overhead {100 * p.overhead:.2f}% (")
    assert p.kept_bytes + p.swapped_bytes + p.recomputed_bytes > 0
    # The search bounds every schedule's overhead: the plan is never below the bound.
    assert p.lower_bound is not None and 0.0 <= p.lower_bound <= p.overhead + 1e-12
    source, holds_for = p.lower_bound_source
    assert source and "schedule" in holds_for
    assert any(line.startswith("lower bound   ") for line in lines)
    assert any(line.startswith("order         ") for line in lines)
    assert isinstance(p.reorders, bool)
    assert p.timeline and max(b for _, _, b in p.timeline) == p.peak_bytes


def remat_binary():
    """The `remat` binary: $REMAT_BIN, or the workspace's release build."""
    explicit = os.environ.get("REMAT_BIN")
    if explicit:
        return explicit
    built = REPO / "target" / "release" / "remat"
    return str(built) if built.is_file() else None


def test_the_numbers_are_the_cli_numbers(graph_path):
    binary = remat_binary()
    if binary is None:
        pytest.skip("no remat binary: set REMAT_BIN or run `cargo build --release -p remat-cli`")
    for budget, strategy in [("0.5", None), ("0.7", "mutwo"), ("6MiB", "chen-greedy")]:
        args = [binary, "plan", graph_path, "--budget", budget]
        if strategy:
            args += ["--strategy", strategy]
        cli = subprocess.run(args, capture_output=True, text=True, check=True).stdout
        p = remat.plan(graph_path, budget, strategy=strategy)
        # The CLI's header line, then exactly the report the package prints.
        header, report = cli.split("\n", 1)
        g = remat.load_graph(graph_path)
        kind = "exact" if g.recompute_floor_exact else "lower bound"
        expected = (
            f"graph {g.name}: {g.num_nodes} nodes, store-all peak "
            f"{remat.human_bytes(g.store_all_peak)}, floor {remat.human_bytes(g.memory_floor)}"
            f", recompute floor {remat.human_bytes(g.recompute_floor)} ({kind})"
        )
        assert header == expected
        # The CLI also prints the search's notes first and its solve time last.
        lines = report.splitlines()
        notes = [line for line in lines if line.startswith(("note: ", "warning: "))]
        body = [line for line in lines
                if line not in notes and not line.startswith("solve time    ")]
        assert body == p.summary().splitlines(), budget
        assert notes == p.notes, budget
        overhead = float(re.search(r"time overhead ([0-9.]+)%", cli).group(1))
        assert overhead == pytest.approx(100 * p.overhead, abs=0.005)


def test_eager_order_plans_say_so_and_unknown_orders_are_refused(graph_path, tmp_path):
    """``order="eager"``: the plan form PyTorch's autograd runs as it is (remat plan --order
    eager); its JSON says so, and it fits the budget."""
    eager = remat.plan(graph_path, 0.7, order="eager")
    out = tmp_path / "plan.json"
    eager.save(out)
    assert json.loads(out.read_text())["order"] == "eager"
    assert eager.peak_bytes <= eager.budget_bytes
    with pytest.raises(remat.ArgumentError, match="order"):
        remat.plan(graph_path, 0.7, order="sideways")
    with pytest.raises(remat.ArgumentError, match="order"):
        remat.plan(graph_path, 0.7, order=3)
