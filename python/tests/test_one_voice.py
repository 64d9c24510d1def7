"""One voice: each bad value gets the same message and the same kind of failure from every
front end that takes it. A table of (fault, the value as the command line writes it, the
value as Python passes it, the front ends, a fragment of the message); each front end's
message, after its own name for the flag or argument (``--budget`` / ``budget`` /
``memory_budget``) and the value, must be the same text. The command exits with status 2
(a bad value, told before anything runs: nothing on stdout), Python raises exactly
``remat.ArgumentError``."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from typing import Any, Callable

import pytest

import remat
from remat_test_graphs import chain_graph, write_chain
from test_plan import remat_binary


@dataclass(frozen=True)
class FrontEnd:
    """One way to give a value: ``cli`` builds the command's arguments around the text
    (``flag`` names it there), ``call`` passes the Python value (``name`` names it)."""

    flag: str
    cli: Callable[[str, str], list] | None = None
    name: str = ""
    call: Callable[[Any, str], Any] | None = None


def _auto_checkpoint(value, _graph):
    torch = pytest.importorskip("torch")
    import remat.torch as rt

    return rt.auto_checkpoint(torch.nn.Linear(2, 2), value)


def _auto_checkpoint_bandwidth(value):
    torch = pytest.importorskip("torch")
    import remat.torch as rt

    return rt.auto_checkpoint(torch.nn.Linear(2, 2), 0.5, bandwidth=value)


FRONT_ENDS = {
    # Budgets.
    "remat plan --budget": FrontEnd("--budget", lambda v, g: ["plan", g, "--budget", v]),
    "remat train --memory-budget": FrontEnd(
        "--memory-budget", lambda v, g: ["train", "--memory-budget", v]),
    "remat spec inspect --memory-budget": FrontEnd(
        "--memory-budget", lambda v, g: ["spec", "inspect", "--memory-budget", v]),
    "remat.plan(budget=)": FrontEnd("", name="budget", call=lambda v, g: remat.plan(g, v)),
    "auto_checkpoint(memory_budget=)": FrontEnd("", name="memory_budget", call=_auto_checkpoint),
    # Bandwidths and time limits.
    "remat plan --bandwidth": FrontEnd(
        "--bandwidth", lambda v, g: ["plan", g, "--budget", "0.5", "--bandwidth", v]),
    "remat.plan(bandwidth=)": FrontEnd(
        "", name="bandwidth", call=lambda v, g: remat.plan(g, 0.5, bandwidth=v)),
    "auto_checkpoint(bandwidth=)": FrontEnd(
        "", name="bandwidth", call=lambda v, g: _auto_checkpoint_bandwidth(v)),
    "remat plan --time-limit": FrontEnd(
        "--time-limit", lambda v, g: ["plan", g, "--budget", "0.5", "--time-limit", v]),
    "remat.plan(time_limit=)": FrontEnd(
        "", name="time_limit", call=lambda v, g: remat.plan(g, 0.5, time_limit=v)),
    # Resharding: no source is read before the arguments are checked.
    "remat reshard --world-size": FrontEnd(
        "--world-size", lambda v, g: ["reshard", g + ".none", g + ".out", "--world-size", v]),
    "remat.reshard(world_size=)": FrontEnd(
        "", name="world_size", call=lambda v, g: remat.reshard(g + ".none", g + ".out", v)),
    "remat reshard --max-buffer": FrontEnd(
        "--max-buffer", lambda v, g: ["reshard", g + ".none", g + ".out", "-w", "2",
                                      "--max-buffer", v]),
    "remat.reshard(max_buffer=)": FrontEnd(
        "", name="max_buffer",
        call=lambda v, g: remat.reshard(g + ".none", g + ".out", 2, max_buffer=v)),
    "remat reshard --rank": FrontEnd(
        "--rank", lambda v, g: ["reshard", g + ".none", g + ".out", "-w", "2", "--rank", v]),
    "remat plan --order": FrontEnd(
        "--order", lambda v, g: ["plan", g, "--budget", "0.5", "--order", v]),
    "remat.plan(order=)": FrontEnd(
        "", name="order", call=lambda v, g: remat.plan(g, 0.5, order=v)),
    "remat reshard --format": FrontEnd(
        "--format", lambda v, g: ["reshard", g + ".none", g + ".out", "-w", "2", "--format", v]),
    "remat.reshard(format=)": FrontEnd(
        "", name="format", call=lambda v, g: remat.reshard(g + ".none", g + ".out", 2, format=v)),
    "remat reshard --from": FrontEnd(
        "--from", lambda v, g: ["reshard", g + ".none", g + ".out", "-w", "2", "--from", v]),
    "remat.reshard(source_format=)": FrontEnd(
        "", name="source_format",
        call=lambda v, g: remat.reshard(g + ".none", g + ".out", 2, source_format=v)),
    "remat reshard --preset": FrontEnd(
        "--preset", lambda v, g: ["reshard", g + ".none", g + ".out", "-w", "2", "--preset", v]),
    "remat.reshard(preset=)": FrontEnd(
        "", name="preset", call=lambda v, g: remat.reshard(g + ".none", g + ".out", 2, preset=v)),
    "remat.reshard(rank=)": FrontEnd(
        "", name="rank", call=lambda v, g: remat.reshard(g + ".none", g + ".out", 2, rank=v)),
}

BANDWIDTHS = ["remat plan --bandwidth", "remat.plan(bandwidth=)", "auto_checkpoint(bandwidth=)"]
BUDGETS = ["remat plan --budget", "remat train --memory-budget",
           "remat spec inspect --memory-budget", "remat.plan(budget=)",
           "auto_checkpoint(memory_budget=)"]

# (fault, text on the command line, value in Python, front ends, fragment of the message)
CASES = [
    ("a zero budget", "0", 0, BUDGETS, "comes to 0 bytes, which holds nothing"),
    ("a zero budget with a unit", "0GiB", "0GiB", BUDGETS, "comes to 0 bytes"),
    ("a negative budget", "-1GB", "-1GB", BUDGETS, "the value is negative"),
    ("a negative budget in bytes", "-1", -1, BUDGETS, "the value is negative"),
    ("a fraction above 1", "1.5", 1.5, BUDGETS, "a fraction must be in (0, 1]"),
    ("garbage text", "lots", "lots", BUDGETS, "not a size"),
    ("an unknown unit", "7parsecs", "7parsecs", BUDGETS, "unknown unit `parsecs`"),
    ("a budget of one byte", "1", 1, BUDGETS,
     "1 byte cannot hold a training step (a budget in bytes is at least 1 KiB); "
     "did you mean a fraction (1.0) or a size (1GiB)?"),
    ("a budget under a kilobyte", "1000", 1000, BUDGETS, "1000 bytes cannot hold"),
    ("a bandwidth of 0", "0", 0, BANDWIDTHS,
     "comes to 0 bytes per second"),
    ("a negative bandwidth", "-1", -1, BANDWIDTHS,
     "the value is negative"),
    ("a time limit of 0", "0", 0, ["remat plan --time-limit", "remat.plan(time_limit=)"],
     "must be more than 0 seconds"),
    ("a negative time limit", "-1", -1, ["remat plan --time-limit", "remat.plan(time_limit=)"],
     "the value is negative"),
    ("a world size of 0", "0", 0, ["remat reshard --world-size", "remat.reshard(world_size=)"],
     "must be at least 1"),
    ("a negative world size", "-2", -2,
     ["remat reshard --world-size", "remat.reshard(world_size=)"], "the value is negative"),
    ("a world size beyond 2^20", "2097152", 1 << 21,
     ["remat reshard --world-size", "remat.reshard(world_size=)"],
     "target world size 2097152 is more than"),
    ("a buffer of 0 bytes", "0", 0, ["remat reshard --max-buffer", "remat.reshard(max_buffer=)"],
     "comes to 0 bytes, which holds nothing; give at least 1 byte"),
    ("a negative buffer", "-1MiB", "-1MiB",
     ["remat reshard --max-buffer", "remat.reshard(max_buffer=)"], "the value is negative"),
    ("a negative rank", "-1", -1, ["remat reshard --rank", "remat.reshard(rank=)"],
     "the value is negative"),
    ("a rank the world size does not have", "2", 2,
     ["remat reshard --rank", "remat.reshard(rank=)"],
     "not a rank of the target world size 2 (ranks are 0 to 1)"),
    ("an unknown layout", "zip", "zip",
     ["remat reshard --format", "remat.reshard(format=)", "remat reshard --from",
      "remat.reshard(source_format=)"], "unknown layout `zip` (remat, dcp, hf)"),
    ("an unknown preset", "fancy", "fancy", ["remat reshard --preset", "remat.reshard(preset=)"],
     "unknown preset `fancy` (simple, parallel)"),
    ("an unknown plan order", "zigzag", "zigzag", ["remat plan --order", "remat.plan(order=)"],
     "unknown order; known: free, node, eager"),
]


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    return write_chain(tmp_path_factory.mktemp("one-voice") / "chain.json")


def _cli_message(front: FrontEnd, text: str, graph: str) -> str:
    binary = remat_binary()
    if binary is None:
        pytest.skip("no remat binary: set REMAT_BIN or run `cargo build --release -p remat-cli`")
    run = subprocess.run([binary, *front.cli(text, graph)], capture_output=True, text=True,
                         timeout=120)
    where = f"{front.flag} {text}"
    assert run.returncode == 2, f"{where}: exit {run.returncode}\n{run.stderr}"
    assert run.stdout == "", f"{where}: printed before the error:\n{run.stdout}"
    first = run.stderr.splitlines()[0]
    prefix = f"error: {where}: "
    assert first.startswith(prefix), f"{where}: {run.stderr}"
    assert run.stderr.rstrip().endswith("For more information, try '--help'."), run.stderr
    return first[len(prefix):]


def _python_message(front: FrontEnd, value: Any, graph: str) -> str:
    with pytest.raises(remat.RematError) as info:
        front.call(value, graph)
    error = info.value
    where = f"{front.name} {value}"
    assert type(error) is remat.ArgumentError, f"{where}: {type(error).__name__}: {error}"
    assert error.argument == front.name, f"{where}: argument {error.argument!r}"
    prefix = f"{where}: "
    assert str(error).startswith(prefix), f"{where}: {error}"
    return str(error)[len(prefix):]


@pytest.mark.parametrize("fault, text, value, fronts, says", CASES,
                         ids=[case[0] for case in CASES])
def test_one_value_gets_one_message_from_every_front_end(graph, fault, text, value, fronts,
                                                         says):
    messages = {}
    for name in fronts:
        front = FRONT_ENDS[name]
        if front.cli is not None:
            messages[name] = _cli_message(front, text, graph)
        else:
            messages[name] = _python_message(front, value, graph)
    for name, message in messages.items():
        assert says in message, f"{fault}: {name}: {message}"
    assert len(set(messages.values())) == 1, f"{fault}: {messages}"


def test_a_budget_no_plan_fits_is_not_an_argument_error(graph):
    """A budget that was read but fits no plan is a BudgetError (the run failed: exit 1),
    never an ArgumentError (the value could not be used: exit 2)."""
    g = remat.load_graph(graph)
    with pytest.raises(remat.BudgetError) as info:
        remat.plan(g, g.memory_floor - 1)
    assert not isinstance(info.value, remat.ArgumentError)
    binary = remat_binary()
    if binary is None:
        pytest.skip("no remat binary")
    run = subprocess.run([binary, "plan", graph, "--budget", str(g.memory_floor - 1)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    assert "below the graph's memory floor" in run.stderr


def test_a_small_graph_is_planned_at_a_budget_under_a_kilobyte(tmp_path):
    """The 1 KiB rule is for budgets of training steps: a synthetic graph whose store-all
    peak is itself under 1 KiB is planned at any budget in bytes."""
    data = chain_graph(layers=2, activation_bytes=64)
    data["static_bytes"] = 0
    g = remat.Graph.from_json(json.dumps(data))
    assert g.store_all_peak < 1024
    assert remat.plan(g, g.store_all_peak).peak_bytes <= g.store_all_peak
