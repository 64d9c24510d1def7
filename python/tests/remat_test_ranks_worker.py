"""The worker processes of test_auto_ranks: two CPU ranks over gloo train a tiny model with
DDP or FSDP2 ``fully_shard``, plain and under ``auto_checkpoint``, and write what the
parent test compares (each rank's plan decisions; whether its losses and gradients equal
the plain run's; the errors the mismatch cases raised). Kept apart from the test module so
that spawned children import only this (and torch), not pytest's test modules."""

from __future__ import annotations

import copy
import datetime
import json
import os
import traceback
import warnings

import torch
import torch.distributed as dist

import remat.torch as rt

F = torch.nn.functional


class Block(torch.nn.Module):
    def __init__(self, d, p):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class Net(torch.nn.Module):
    def __init__(self, d=32, layers=4, p=0.1, vocab=50):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(Block(d, p) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids, labels):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def batch(rank: int, step: int, seq: int = 64):
    g = torch.Generator().manual_seed(100 * rank + step)
    ids = torch.randint(0, 50, (8, seq), generator=g)
    return ids, torch.roll(ids, 1, 1)


def train(rank, model, steps, local_grad, seq=64):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(steps):
        torch.manual_seed(1000 * rank + step)
        loss = model(*batch(rank, step, seq))
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append([local_grad(p.grad).clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def same(a, b) -> bool:
    (la, ga), (lb, gb) = a, b
    return (all(torch.equal(x, y) for x, y in zip(la, lb))
            and all(torch.equal(x, y) for sa, sb in zip(ga, gb) for x, y in zip(sa, sb)))


def decisions(inner) -> dict:
    plan = rt.controller(inner).plan
    return {"decisions": {str(k): v for k, v in sorted(plan.decisions.items())},
            "groups": len(plan.group_recipes), "strategy": plan.strategy,
            "recompute": plan.count("recompute"), "predicted_peak": plan.predicted_peak,
            "budget_bytes": plan.budget_bytes}


def ddp_case(rank, budgets, share):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    base = Net()
    eager = train(rank, DDP(copy.deepcopy(base)), 3, lambda g: g)
    inner = rt.auto_checkpoint(copy.deepcopy(base), budgets[rank], share_plan=share)
    planned = train(rank, DDP(inner), 3, lambda g: g)
    return {"identical": same(eager, planned), **decisions(inner)}


def fsdp_case(rank, world, budgets):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    base = Net()

    def shard(model):
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    eager = train(rank, shard(copy.deepcopy(base)), 5, lambda g: g.to_local())
    inner = rt.auto_checkpoint(copy.deepcopy(base), budgets[rank])
    with warnings.catch_warnings():
        # FSDP2's first forward runs other ops than the later ones (see test_auto_compose).
        warnings.filterwarnings("ignore", message="remat: this step diverged")
        planned = train(rank, shard(inner), 5, lambda g: g.to_local())
    return {"identical": same(eager, planned), **decisions(inner)}


def mismatch_case(rank):
    """Rank 1 feeds another sequence length: planning must fail on both ranks, not hang."""
    torch.manual_seed(0)
    model = rt.auto_checkpoint(Net(), 0.5)
    try:
        train(rank, model, 2, lambda g: g, seq=64 if rank == 0 else 32)
    except rt.PlanMismatchError as e:
        return {"error": str(e), "field": e.field}
    return {"error": None}


def run(rank, world, port, out_dir, case):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # A collective that never completes fails after this, rather than blocking the test.
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        if case == "ddp":
            result = ddp_case(rank, (0.3, 0.9), True)
        elif case == "ddp-apart":
            result = ddp_case(rank, (0.3, 0.9), False)
        elif case == "fsdp":
            result = fsdp_case(rank, world, (0.8, 1.0))
        else:
            result = mismatch_case(rank)
    except Exception:
        result = {"failed": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"{case}-rank-{rank}.json"), "w") as f:
        json.dump(result, f)
