"""Bad input gives a remat exception naming the file, node, field, argument or tensor at
fault, with the command's message, and leaves nothing written."""

from __future__ import annotations

import json
import os

import pytest

import remat
from remat_test_graphs import chain_graph, write_chain


@pytest.fixture()
def graph_path(tmp_path):
    return write_chain(tmp_path / "chain.json")


def test_the_exception_classes_nest_as_documented():
    for cls in (remat.GraphError, remat.BudgetError, remat.PlanError, remat.ReshardError,
                remat.ArgumentError, remat.OutputError):
        assert issubclass(cls, remat.RematError)
    assert issubclass(remat.BudgetError, ValueError)
    assert issubclass(remat.ArgumentError, ValueError)
    # A budget no plan fits is not a value that cannot be read.
    assert not issubclass(remat.BudgetError, remat.ArgumentError)


def test_a_graph_that_is_not_json_names_the_file(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text('{"format": "remat-graph", "version": 1, "nodes": [')
    with pytest.raises(remat.GraphError) as info:
        remat.load_graph(bad)
    assert str(info.value).startswith(f"{bad}: not valid JSON")
    assert info.value.file == str(bad) and info.value.node is None


def test_a_bad_field_names_the_file_node_and_field(tmp_path):
    data = chain_graph(layers=2)
    data["nodes"][1]["output_bytes"] = -5
    bad = tmp_path / "neg.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(remat.GraphError) as info:
        remat.plan(str(bad), 0.5)
    e = info.value
    assert e.file == str(bad) and e.field == "output_bytes" and "f1" in e.node, str(e)
    assert "field `output_bytes`" in str(e) and "f1" in str(e)
    # From text, the file is named as given.
    with pytest.raises(remat.GraphError) as info:
        remat.Graph.from_json(json.dumps(data), file="captured.json")
    assert str(info.value).startswith("captured.json: node")


def test_a_missing_graph_file_names_it(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(remat.GraphError) as info:
        remat.plan(missing, 0.5)
    assert str(info.value).startswith(f"{missing}: cannot read")


def test_a_budget_below_the_floor_names_the_floor(graph_path, tmp_path):
    g = remat.load_graph(graph_path)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(remat.BudgetError) as info:
        remat.plan(g, g.memory_floor - 1)
    e = info.value
    assert isinstance(e, ValueError)
    assert e.budget_bytes == g.memory_floor - 1 and e.floor_bytes == g.memory_floor
    assert f"memory floor {remat.human_bytes(g.memory_floor)}" in str(e)
    assert sorted(os.listdir(tmp_path)) == before
    # At the floor itself some strategy fits (this chain: recompute everything).
    assert remat.plan(g, g.memory_floor).peak_bytes <= g.memory_floor


def test_a_budget_no_strategy_fits_states_the_smallest_peak(graph_path):
    g = remat.load_graph(graph_path)
    with pytest.raises(remat.BudgetError) as info:
        remat.plan(g, g.store_all_peak - 1, strategy="store-all")
    e = info.value
    assert e.best_peak == g.store_all_peak and e.strategy == "store-all"
    assert e.floor_bytes == g.memory_floor
    assert "infeasible" in str(e)


@pytest.mark.parametrize(
    "budget, says",
    [
        ("", "budget: an empty value"),
        ("7 parsecs", "unknown unit `parsecs`"),
        ("1.5", "a fraction must be in (0, 1]"),
        ("0", "comes to 0 bytes"),
        ("-3", "is negative"),
        (0.0, "must be in (0, 1]"),
        (1.5, "must be in (0, 1]"),
        (float("nan"), "budget nan: not a size"),
        (-4, "is negative"),
        (1 << 70, "more than 2^64 - 1 bytes"),
        (1, "1 byte cannot hold a training step"),
        (True, "give bytes"),
        ([1], "not list"),
    ],
)
def test_unreadable_budgets_name_the_argument(graph_path, budget, says):
    with pytest.raises(remat.ArgumentError) as info:
        remat.plan(graph_path, budget)
    assert str(info.value).startswith("budget"), str(info.value)
    assert says in str(info.value)


def test_unknown_strategies_list_the_known_ones(graph_path):
    with pytest.raises(remat.PlanError) as info:
        remat.plan(graph_path, 0.9, strategy="fastest-please")
    assert info.value.strategy == "fastest-please"
    # As `remat plan --strategy fastest-please` says it, after the argument's name.
    assert str(info.value).startswith(
        "strategy fastest-please: unknown strategy `fastest-please`; known: store-all")
    with pytest.raises(remat.PlanError) as info:
        remat.plan(graph_path, 0.9, strategy="every:0")
    assert "every:0" in str(info.value)


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"bandwidth": 0}, "bandwidth 0"),
        ({"bandwidth": "0.4"}, "bandwidth 0.4: comes to 0 bytes per second"),
        ({"bandwidth": "fast"}, "bandwidth fast: "),
        ({"bandwidth": float("inf")}, "bandwidth inf"),
        ({"time_limit": 0}, "time_limit 0: must be more than 0 seconds"),
        ({"time_limit": "1s"}, "time_limit: give seconds"),
    ],
)
def test_bad_bandwidths_and_time_limits_name_the_argument(graph_path, kwargs, says):
    with pytest.raises(remat.ArgumentError) as info:
        remat.plan(graph_path, 0.9, **kwargs)
    assert says in str(info.value)


def test_saving_to_a_directory_or_a_missing_one_writes_nothing(graph_path, tmp_path):
    p = remat.plan(graph_path, 0.9)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(remat.OutputError, match="is a directory"):
        p.save(out)
    with pytest.raises(remat.OutputError, match="does not exist"):
        p.save(out / "missing" / "plan.json")
    with pytest.raises(remat.OutputError, match="same file"):
        p.save(out / "a.svg", plot=out / "a.svg")
    with pytest.raises(remat.ArgumentError, match="svg or .png"):
        p.save(out / "plan.json", plot=out / "plan.jpg")
    assert os.listdir(out) == []


def hf_checkpoint(directory):
    """A one-file Hugging Face checkpoint of two tensors."""
    np = pytest.importorskip("numpy")
    st = pytest.importorskip("safetensors.numpy")
    directory.mkdir()
    st.save_file(
        {"w": np.arange(24, dtype=np.float32).reshape(6, 4), "b": np.ones(3, dtype=np.float16)},
        str(directory / "model.safetensors"),
    )
    return directory


@pytest.mark.parametrize(
    "world_size, says",
    [
        (0, "world_size 0: must be at least 1"),
        (-2, "world_size -2: the value is negative; give a whole number"),
        (1 << 21, "world_size 2097152: target world size 2097152 is more than"),
        (1 << 80, "world_size 1208925819614629174706176: out of range"),
        (2.0, "world_size: give a whole number (int), not float"),
    ],
)
def test_a_wrong_world_size_names_the_argument_and_writes_nothing(tmp_path, world_size, says):
    src = hf_checkpoint(tmp_path / "src")
    dst = tmp_path / "dst"
    with pytest.raises(remat.ArgumentError) as info:
        remat.reshard(src, dst, world_size)
    assert str(info.value).startswith(says), str(info.value)
    assert not dst.exists()


def test_a_rank_the_world_size_cannot_take_names_the_tensor(tmp_path):
    src = hf_checkpoint(tmp_path / "src")
    dst = tmp_path / "dst"
    with pytest.raises(remat.ReshardError) as info:
        remat.reshard(src, dst, 2, place=[("w", "rank:2")])
    assert info.value.tensor == "w"
    assert str(info.value) == "tensor `w`: rule asks for rank 2 but the target has 2 ranks"
    assert not dst.exists()


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"format": "zip"}, "format zip: unknown layout `zip` (remat, dcp, hf)"),
        ({"source_format": "ckpt"}, "source_format ckpt: unknown layout `ckpt`"),
        ({"preset": "fancy"}, "preset fancy: unknown preset `fancy`"),
        ({"place": [("w", "sideways")]}, 'place: ("w", "sideways") is not (PATTERN, RULE)'),
        ({"place": ["w=shard(0)"]}, "place: 'w=shard(0)' is not a (PATTERN, RULE) pair"),
        ({"max_buffer": "lots"}, "max_buffer lots: not a size"),
        ({"max_buffer": -1}, "max_buffer -1: the value is negative"),
        ({"max_buffer": 1 << 64}, "max_buffer 18446744073709551616: out of range"),
        ({"max_buffer": 0}, "max_buffer 0: comes to 0 bytes, which holds nothing"),
        ({"dry_run": True, "finalize": True}, "dry_run and finalize"),
    ],
)
def test_bad_reshard_arguments_are_named_before_anything_is_read(tmp_path, kwargs, says):
    dst = tmp_path / "dst"
    # The source does not exist: argument errors come first.
    with pytest.raises(remat.ArgumentError) as info:
        remat.reshard(tmp_path / "no-source", dst, 2, **kwargs)
    assert str(info.value).startswith(says), str(info.value)
    assert not dst.exists()


def test_a_missing_or_unreadable_source_names_the_file(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(remat.ReshardError) as info:
        remat.reshard(missing, tmp_path / "dst", 2)
    assert str(info.value).startswith(f"reading {missing}: ")
    assert info.value.path == str(missing)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"\x03\x00")
    with pytest.raises(remat.ReshardError) as info:
        remat.reshard(bad, tmp_path / "dst", 2)
    assert "model.safetensors" in str(info.value) and "truncated" in str(info.value)
    assert not (tmp_path / "dst").exists()


def test_existing_output_needs_force(tmp_path):
    src = hf_checkpoint(tmp_path / "src")
    dst = tmp_path / "dst"
    remat.reshard(src, dst, 2)
    with pytest.raises(remat.ReshardError, match="output already exists"):
        remat.reshard(src, dst, 3)
    assert remat.reshard(src, dst, 3, force=True)["files_written"] == 3
