"""PyTorch's distributed checkpoint loads remat's DCP output: a state dict saved by
``torch.distributed.checkpoint`` on 2 CPU ranks (gloo) is resharded by ``remat.reshard`` to
2 and 3 ranks, then loaded by DCP on 2 and 3 processes into DTensors sharded on dim 0;
every local shard must equal its slice of the original, byte for byte. Also the shared
fixture (a real 4-rank PyTorch checkpoint), when ../shared is there.

Each case starts processes that import torch: slow (about 10 s a case on 2 cores)."""

from __future__ import annotations

import json
import os
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
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="torch.distributed with gloo is not available"),
]

FIXTURE = pathlib.Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "torch-dcp-hf-w4"


def spawn(fn, world: int, tmp_path, *args) -> None:
    """Runs ``fn(rank, world, init_file, *args)`` on ``world`` processes."""
    init_file = tmp_path / f"store-{fn.__name__}-{world}-{len(os.listdir(tmp_path))}"
    mp.spawn(fn, args=(world, str(init_file), *args), nprocs=world, join=True)


def load_everywhere(tmp_path, checkpoint, world: int, source: str) -> dict:
    results = tmp_path / f"results-{checkpoint.name}"
    results.mkdir()
    spawn(worker.load_and_check, world, tmp_path, str(checkpoint), str(results), source)
    per_rank = [json.loads((results / f"rank-{r}.json").read_text()) for r in range(world)]
    return {name: [shapes[name] for shapes in per_rank] for name in per_rank[0]}


@pytest.fixture(scope="module")
def torch_checkpoint(tmp_path_factory):
    """The state dict saved by DCP on 2 ranks with the Hugging Face storage writer."""
    tmp = tmp_path_factory.mktemp("dcp")
    path = tmp / "saved-w2"
    spawn(worker.save, 2, tmp, str(path))
    return path


@pytest.mark.parametrize("world", [2, 3])
def test_dcp_loads_remats_output_into_the_right_shards(torch_checkpoint, tmp_path, world):
    out = tmp_path / f"remat-w{world}"
    report = remat.reshard(torch_checkpoint, out, world, format="dcp")
    assert report["source_format"] == "dcp" and report["source_world_size"] == 2
    assert report["files_written"] == world
    shapes = load_everywhere(tmp_path, out, world, "state_dict")
    # Every tensor was checked on every rank; the rows add up to the whole tensor.
    full = worker.state_dict()
    assert sorted(shapes) == sorted(full)
    for name, tensor in full.items():
        if tensor.dim():
            assert sum(s[0] for s in shapes[name]) == tensor.shape[0], name


def test_dcp_loads_the_shared_fixture_after_remat_reshards_it(tmp_path):
    if not FIXTURE.is_dir():
        pytest.skip(f"shared fixture {FIXTURE} is absent (../shared beside the checkout)")
    # Reads ../shared/fixtures/torch-dcp-hf-w4. PyTorch cannot load it as written (an empty
    # piece, see its README); resharded by remat, it loads on 2 and 3 ranks.
    for world in (2, 3):
        out = tmp_path / f"fixture-w{world}"
        remat.reshard(FIXTURE, out, world, format="dcp")
        shapes = load_everywhere(tmp_path, out, world, str(FIXTURE / "full.safetensors"))
        assert len(shapes) == 9
