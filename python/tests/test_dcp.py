"""PyTorch's distributed checkpoint loads remat's DCP output: a state dict saved by
``torch.distributed.checkpoint`` on 2 CPU ranks (gloo) is resharded by ``remat.reshard`` to
2 and 3 ranks, then loaded by DCP on 2 and 3 processes into DTensors sharded on dim 0;
every local shard must equal its slice of the original, byte for byte. Also the shared
fixture (a real 4-rank PyTorch checkpoint), when ../shared is there.

Slow: the processes import torch (three groups of processes in all: one saves, one loads
on 2 ranks, one on 3; each load group checks every checkpoint of its world size)."""

from __future__ import annotations

import json
import pathlib

import pytest

import remat

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import remat_test_dcp_worker as worker  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(),
        reason="torch.distributed with gloo is not available",
    ),
]

FIXTURE = pathlib.Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "torch-dcp-hf-w4"
WORLDS = (2, 3)


def spawn(fn, world: int, init_file: pathlib.Path, *args) -> None:
    """Runs ``fn(rank, world, init_file, *args)`` on ``world`` processes."""
    mp.spawn(fn, args=(world, str(init_file), *args), nprocs=world, join=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """Per world size: remat's reports and, per checkpoint ("torch": the state dict DCP
    saved on 2 ranks; "fixture": the shared one, when present), the local shapes each rank
    loaded and checked."""
    tmp = tmp_path_factory.mktemp("dcp")
    saved = tmp / "saved-w2"
    spawn(worker.save, 2, tmp / "store-save", str(saved))
    results = {}
    for world in WORLDS:
        out = tmp / f"remat-w{world}"
        reports = {"torch": remat.reshard(saved, out, world, format="dcp")}
        jobs = [("torch", str(out), "state_dict")]
        if FIXTURE.is_dir():
            # Reads ../shared/fixtures/torch-dcp-hf-w4.
            fixture_out = tmp / f"fixture-w{world}"
            reports["fixture"] = remat.reshard(FIXTURE, fixture_out, world, format="dcp")
            jobs.append(("fixture", str(fixture_out), str(FIXTURE / "full.safetensors")))
        result_dir = tmp / f"results-w{world}"
        result_dir.mkdir()
        spawn(worker.load_and_check, world, tmp / f"store-load-{world}", jobs, str(result_dir))
        shapes = {}
        for label, _, _ in jobs:
            per_rank = [
                json.loads((result_dir / f"{label}-rank-{r}.json").read_text())
                for r in range(world)
            ]
            shapes[label] = {name: [ranks[name] for ranks in per_rank] for name in per_rank[0]}
        results[world] = (reports, shapes)
    return results


@pytest.mark.parametrize("world", WORLDS)
def test_dcp_loads_remats_output_into_the_right_shards(loaded, world):
    reports, shapes = loaded[world]
    report = reports["torch"]
    assert report["source_format"] == "dcp" and report["source_world_size"] == 2
    assert report["files_written"] == world
    # Every tensor was checked on every rank; the rows add up to the whole tensor.
    full = worker.state_dict()
    assert sorted(shapes["torch"]) == sorted(full)
    for name, tensor in full.items():
        per_rank = shapes["torch"][name]
        assert len(per_rank) == world
        if tensor.dim():
            assert sum(s[0] for s in per_rank) == tensor.shape[0], name


@pytest.mark.parametrize("world", WORLDS)
def test_dcp_loads_the_shared_fixture_after_remat_reshards_it(loaded, world):
    if not FIXTURE.is_dir():
        pytest.skip(f"shared fixture {FIXTURE} is absent (../shared beside the checkout)")
    # PyTorch cannot load the fixture as written (an empty piece, see its README);
    # resharded by remat, it loads on 2 and 3 ranks, equal to its full.safetensors.
    reports, shapes = loaded[world]
    assert reports["fixture"]["source_world_size"] == 4
    assert len(shapes["fixture"]) == 9
    assert all(len(ranks) == world for ranks in shapes["fixture"].values())
