"""Worker processes of test_dcp.py (not a test module): each joins a gloo process group
through a file store on localhost, then saves or loads a DCP checkpoint as DTensors sharded
on dim 0 of a 1-D CPU mesh. Kept apart from the test module so that spawned children
import only this file and torch."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor import zeros as dtensor_zeros


def state_dict() -> dict:
    """The original tensors: several dtypes and shapes, and a scalar kept replicated."""
    g = torch.Generator().manual_seed(17)
    return {
        "embed.weight": torch.randn(10, 6, generator=g),
        "mlp.up.weight": torch.randn(7, 4, generator=g).to(torch.bfloat16),
        "norm.bias": torch.randn(5, generator=g).to(torch.float16),
        "router.counts": torch.randint(-(1 << 40), 1 << 40, (9, 2), generator=g),
        "conv.weight": torch.randn(3, 3, 2, generator=g, dtype=torch.float64),
        "step": torch.tensor(1234, dtype=torch.int64),
    }


def dim0_slice(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s piece of ``full`` under Shard(0): chunks of ceil(n / world) rows,
    the last ones smaller or empty."""
    n = full.shape[0]
    size = -(-n // world)
    start = min(rank * size, n)
    return full[start : min(start + size, n)]


def join(rank: int, world: int, init_file: str):
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
    )
    return init_device_mesh("cpu", (world,))


def save(rank: int, world: int, init_file: str, path: str) -> None:
    """Saves :func:`state_dict` sharded on dim 0 over ``world`` ranks, with the Hugging
    Face storage writer, as the shared fixture was written (one file per rank)."""
    mesh = join(rank, world, init_file)
    try:
        sd = {}
        for name, full in state_dict().items():
            if full.dim() == 0:
                sd[name] = full
                continue
            local = dim0_slice(full, rank, world).contiguous()
            sd[name] = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
            )
        writer = dcp.HuggingFaceStorageWriter(path=path, save_distributed=True)
        dcp.save(sd, storage_writer=writer)
    finally:
        dist.destroy_process_group()


def load_and_check(rank: int, world: int, init_file: str, jobs: list, result_dir: str) -> None:
    """For each ``(label, checkpoint, source)`` of ``jobs``: loads the checkpoint with DCP
    into DTensors sharded on dim 0 and checks each local shard against the right slice of
    the original (``source``: "state_dict", or a safetensors file of whole tensors); writes
    the local shapes it checked to ``result_dir/LABEL-rank-R.json``. One process group
    serves every job: starting processes that import torch is the slow part."""
    mesh = join(rank, world, init_file)
    try:
        for label, path, source in jobs:
            checked = _load_and_check_one(rank, world, mesh, path, source)
            with open(os.path.join(result_dir, f"{label}-rank-{rank}.json"), "w") as f:
                json.dump(checked, f)
    finally:
        dist.destroy_process_group()


def _load_and_check_one(rank: int, world: int, mesh, path: str, source: str) -> dict:
    expected = _expected(source)
    sd = {}
    for name, full in expected.items():
        if full.dim() == 0:
            sd[name] = torch.zeros_like(full)
        else:
            sd[name] = dtensor_zeros(
                *full.shape, dtype=full.dtype, device_mesh=mesh, placements=[Shard(0)]
            )
    dcp.load(sd, storage_reader=dcp.HuggingFaceStorageReader(path))
    checked = {}
    for name, full in expected.items():
        got = sd[name] if full.dim() == 0 else sd[name].to_local()
        want = full if full.dim() == 0 else dim0_slice(full, rank, world)
        if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
            raise AssertionError(
                f"{path}: rank {rank}: {name}: {got.dtype} {tuple(got.shape)}, "
                f"want {want.dtype} {tuple(want.shape)}"
            )
        # Bit for bit: compare the bytes, not the values.
        if not torch.equal(_bytes(got), _bytes(want)):
            raise AssertionError(f"{path}: rank {rank}: {name}: local shard differs from the original")
        checked[name] = list(got.shape)
    return checked


def _expected(source: str) -> dict:
    if source == "state_dict":
        return state_dict()
    from safetensors.torch import load_file

    return load_file(source)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)
