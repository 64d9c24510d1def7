"""The PyTorch peer of `remat bench engine --torch PYTHON` (python/bench_peers/torch_gpt.py),
run as the benchmark runs it (`python -c SCRIPT ARGS`): it says ready with its torch
version, answers each policy with a step time, and ends on an empty line. The Rust side of
the protocol is tested with a fake peer in crates/remat-cli/tests/bench_engine_cli.rs."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "bench_peers" / "torch_gpt.py"


def run_peer(args: list[str], stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT.read_text(), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_peer_says_ready_then_times_each_policy():
    # layers, d_model, heads, ffn, vocab, batch, seq, threads
    proc = run_peer(["1", "32", "4", "64", "64", "1", "16", "1"], "store-all\nper-block\n\n")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"ready {torch.__version__}"
    times = [float(line) for line in lines[1:]]
    assert len(times) == 2 and all(t > 0 for t in times)


def test_peer_refuses_an_unknown_policy_and_wrong_arguments():
    proc = run_peer(["1", "32", "4", "64", "64", "1", "16", "1"], "sqrt\n")
    assert proc.returncode != 0 and "unknown policy 'sqrt'" in proc.stderr
    proc = run_peer(["1", "32"], "")
    assert proc.returncode != 0 and "expected 8 arguments" in proc.stderr
