"""One plan for every rank (``auto_checkpoint``'s ``share_plan``): two CPU processes over
gloo, spawned here, train with DDP and with FSDP2 ``fully_shard``. Each rank is given a
different budget, so ranks planning apart would choose different plans: with the plan
shared, both run rank 0's decisions, and their losses and gradients equal the same job
without remat. With ``share_plan=False`` each rank plans for itself. Ranks fed different
input shapes fail on both ranks with ``PlanMismatchError`` instead of waiting on each
other. Every case runs under a deadline (and the workers' collectives under a timeout), so
a hang fails the test rather than blocking CI.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import remat_test_ranks_worker as worker  # noqa: E402

pytestmark = [
    pytest.mark.slow,  # each case spawns two processes that import torch
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="torch.distributed with gloo is not available"),
]

DEADLINE_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(tmp_path, case: str) -> list[dict]:
    """Runs ``case`` on two ranks; each rank's result. Fails (killing both) past the
    deadline."""
    context = mp.start_processes(worker.run, args=(2, _free_port(), str(tmp_path), case),
                                 nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                pytest.fail(f"{case}: the ranks did not finish in {DEADLINE_S} s (a hang)")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
    results = [json.loads((tmp_path / f"{case}-rank-{r}.json").read_text()) for r in range(2)]
    for r, result in enumerate(results):
        assert "failed" not in result, f"rank {r}:\n{result['failed']}"
    return results


def test_ddp_ranks_run_rank_0s_plan(tmp_path):
    """Rank 0 at 0.3 of the activations, rank 1 at 0.9: both run rank 0's plan (which
    recomputes), and every loss and all-reduced gradient equals DDP without remat."""
    r0, r1 = run_ranks(tmp_path, "ddp")
    assert r0["identical"] and r1["identical"]
    assert r0["recompute"] > 0
    assert r0["decisions"] == r1["decisions"] and r0["strategy"] == r1["strategy"]
    assert r0["groups"] == r1["groups"]
    assert r1["budget_bytes"] == r0["budget_bytes"]  # rank 0's budget, on both


def test_ddp_ranks_plan_apart_when_asked(tmp_path):
    """``share_plan=False``: each rank plans for its own budget (no collective in the
    planning), and gradients still equal DDP without remat."""
    r0, r1 = run_ranks(tmp_path, "ddp-apart")
    assert r0["identical"] and r1["identical"]
    assert r0["budget_bytes"] < r1["budget_bytes"]
    for r in (r0, r1):
        assert r["predicted_peak"] <= r["budget_bytes"]


def test_fsdp2_ranks_run_rank_0s_plan(tmp_path):
    """FSDP2 ``fully_shard`` per block and at the root (its all-gathers run inside every
    block's forward and again before its backward): rank 0 at 0.8, rank 1 at 1.0 (alone it
    would keep everything); both run rank 0's plan, gradient shards equal to FSDP2 without
    remat, no hang."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)")
    r0, r1 = run_ranks(tmp_path, "fsdp")
    assert r0["identical"] and r1["identical"]
    assert r0["recompute"] > 0 and r1["recompute"] == r0["recompute"]
    assert r0["decisions"] == r1["decisions"] and r1["budget_bytes"] == r0["budget_bytes"]


def test_ranks_with_other_input_shapes_fail_together(tmp_path):
    """Rank 1 feeds sequences of 32, rank 0 of 64: when the second step plans, both ranks
    raise PlanMismatchError naming the signatures (none goes on to wait for the other)."""
    r0, r1 = run_ranks(tmp_path, "mismatch")
    for r in (r0, r1):
        assert r["error"] is not None and r["field"] == "signature", r
        assert "rank 1" in r["error"] and "share_plan=False" in r["error"]
