"""auto_checkpoint inside the loops people already run: gradient accumulation, Hugging Face's
``Trainer``, DDP and FSDP2 (gloo, two CPU processes), ``torch.compile``, and parameters
whose storage is freed between the forward and the backward (as FSDP2 frees them).

Each case runs the same training twice from the same state, without and with remat, and
compares losses, gradients, parameters and the generator state bit for bit (under
``torch.compile``: as close as the compiled run without remat, which is what compile
itself gives). CPU, one thread per process, tiny models.
"""

from __future__ import annotations

import copy
import os
import socket
import warnings

import pytest

torch = pytest.importorskip("torch")

import remat.torch as rt  # noqa: E402
from test_auto import Net, assert_identical, net_batch  # noqa: E402  (the harness)

F = torch.nn.functional


def tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.1,
        embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


# ---- gradient accumulation ---------------------------------------------------------------


def accumulate(model, micro_batches, *, steps=3, seed=1):
    """``steps`` AdamW steps, each over every micro-batch: forward and backward per micro-batch
    (the gradients add up), then one optimizer step."""
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for _ in range(steps):
        for batch in micro_batches:
            loss = model(**batch).loss / len(micro_batches)
            loss.backward()
            losses.append(loss.detach().clone())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {
        "losses": losses,
        "grads": grads,
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": [{k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
                for s in opt.state.values()],
        "rng": torch.get_rng_state(),
    }


def test_gradient_accumulation_identical():
    """Two micro-batches per optimizer step: the second micro-batch's backward adds into the
    gradients the first one left (the profiled step had none), under dropout."""
    g = torch.Generator().manual_seed(0)
    micro = []
    for _ in range(2):
        ids = torch.randint(0, 128, (2, 32), generator=g)
        mask = torch.ones(2, 32, dtype=torch.long)
        mask[1, -5:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        micro.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    torch.manual_seed(0)
    base = tiny_gpt2()
    eager = accumulate(copy.deepcopy(base), micro)
    model = rt.auto_checkpoint(copy.deepcopy(base), 0.6)
    planned = accumulate(model, micro)
    assert_identical(eager, planned)
    c = rt.controller(model)
    assert c.plan.count("recompute") > 0, c.table()
    assert len(c.entries) == 1 and c.entries[next(iter(c.entries))].steps == 5


# ---- Hugging Face Trainer ----------------------------------------------------------------


def trainer_run(model, output_dir):
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
    from transformers import Trainer, TrainingArguments

    # Every example is padded (1 to 4 positions): transformers builds the mask another way
    # when a batch has no padding at all, which would be another step for remat (profiled
    # anew, so still exact, but then 3 steps would leave no planned one to test).
    g = torch.Generator().manual_seed(0)
    data = []
    for i in range(8):
        ids = torch.randint(0, 128, (32,), generator=g)
        mask = torch.ones(32, dtype=torch.long)
        mask[:1 + i % 4] = 0
        data.append({"input_ids": ids, "attention_mask": mask,
                     "labels": ids.masked_fill(mask == 0, -100)})
    args = TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=2, max_steps=3,
        logging_steps=1, learning_rate=1e-2, save_strategy="no", report_to=[], use_cpu=True,
        seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def test_hf_trainer_identical(tmp_path):
    """The Trainer seeds the sampler from ``seed`` / ``data_seed``, so two runs without remat
    see the same batches in the same order; the run with remat sees them too."""
    torch.manual_seed(0)
    base = tiny_llama()
    losses, state = trainer_run(copy.deepcopy(base), tmp_path / "eager")
    model = rt.auto_checkpoint(copy.deepcopy(base), 0.6)
    planned_losses, planned_state = trainer_run(model, tmp_path / "remat")
    assert len(losses) == 3
    assert planned_losses == losses
    assert state.keys() == planned_state.keys()
    for k in state:
        assert torch.equal(state[k], planned_state[k]), f"{k} differs after Trainer"
    c = rt.controller(model)
    assert c.plan is not None and c.plan.count("recompute") > 0, c.table()
    assert c.reprofiles == 0
    assert not any(tmp_path.glob("*/checkpoint-*")), "the Trainer saved a checkpoint"


# ---- DDP and FSDP2 (gloo, two processes) -------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _distributed_train(rank, model, steps, local_grad):
    """``steps`` AdamW steps on this rank's own batches; what must match, per rank."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1 + rank)
    losses, grads = [], []
    for step in range(steps):
        (ids, labels), _ = net_batch(seed=10 * rank + step)
        loss = model(ids, labels)
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append([local_grad(p.grad).clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads, torch.get_rng_state()


def _assert_same(rank, eager, planned):
    (la, ga, ra), (lb, gb, rb) = eager, planned
    for s, (x, y) in enumerate(zip(la, lb)):
        assert torch.equal(x, y), f"rank {rank}: loss of step {s} differs"
    for s, (a, b) in enumerate(zip(ga, gb)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"rank {rank}: gradient {i} of step {s} differs"
    assert torch.equal(ra, rb), f"rank {rank}: generator state differs"


def _ddp_worker(rank, world, port, budget):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        base = Net(d=32, layers=4, p=0.1)
        eager = _distributed_train(rank, DDP(copy.deepcopy(base)), 3, lambda g: g)
        inner = rt.auto_checkpoint(copy.deepcopy(base), budget)
        planned = _distributed_train(rank, DDP(inner), 3, lambda g: g)
        _assert_same(rank, eager, planned)
        c = rt.controller(inner)
        assert c.plan is not None and c.plan.count("recompute") > 0, c.table()
    finally:
        dist.destroy_process_group()


# Two spawned processes import torch and build DDP / FSDP2 (which imports torch._dynamo):
# more than 20 s on two shared cores.
@pytest.mark.slow
def test_ddp_gradients_identical():
    """DDP over a model given to auto_checkpoint: each rank's losses and the all-reduced
    gradients equal DDP without remat (both run in the same two workers)."""
    mp = pytest.importorskip("torch.multiprocessing")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    mp.spawn(_ddp_worker, args=(2, _free_port(), 0.6), nprocs=2)


def _fsdp_worker(rank, world, port, budget):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        base = Net(d=32, layers=4, p=0.1)

        def shard(model):
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model

        # Five steps: FSDP2's first forward initialises itself (other ops than every later
        # one), so remat's second step diverges from the first, profiles the third and
        # runs its plan on the last two.
        eager = _distributed_train(rank, shard(copy.deepcopy(base)), 5, lambda g: g.to_local())
        model = shard(rt.auto_checkpoint(copy.deepcopy(base), budget))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="remat: this step diverged")
            planned = _distributed_train(rank, model, 5, lambda g: g.to_local())
        _assert_same(rank, eager, planned)
        c = rt.controller(model)
        assert c.plan is not None and c.plan.count("recompute") > 0, c.table()
        assert c.entries[next(iter(c.entries))].steps == 2
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_fully_shard_gradients_identical():
    """FSDP2 ``fully_shard`` per block and at the root, on CPU over gloo (torch supports it
    there): every rank's gradient shards equal FSDP2 without remat. FSDP2 frees each block's
    gathered parameters after its forward; rebuilds only replay ops whose parameters are
    back when they run (see test_freed_parameters_are_never_replayed)."""
    mp = pytest.importorskip("torch.multiprocessing")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)")
    # 0.8: the parameters FSDP2 gathers again in the backward are activation bytes of the
    # step that no plan can move (the profile sees them since it watches each node's gradient
    # sums too); the least an eager plan reaches here is about 0.75 of them.
    mp.spawn(_fsdp_worker, args=(2, _free_port(), 0.8), nprocs=2)


# ---- parameters freed between the forward and the backward ---------------------------------


class Sharded(torch.nn.Module):
    """A residual block whose first weight is freed after the forward (its storage resized to
    nothing) and gathered back from a copy when the block's backward begins: FSDP2's life of
    an unsharded parameter, in one process. ``free`` switches the freeing on and off; the
    forward runs the same ops either way (a copy one way or the other)."""

    def __init__(self, d):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.lin2 = torch.nn.Linear(d, d)
        self.master = self.lin.weight.detach().clone()
        self.free = True

    def _gather(self):
        w = self.lin.weight
        storage = w.untyped_storage()
        with torch.no_grad():
            # Through another TensorImpl, so that the weight's version stays.
            if storage.nbytes() == 0:
                storage.resize_(self.master.numel() * self.master.element_size())
                torch.empty(0).set_(storage, 0, w.shape, w.stride()).copy_(self.master)
            else:  # the optimizer may have changed it
                self.master.copy_(torch.empty(0).set_(storage, 0, w.shape, w.stride()))

    def forward(self, x):
        self._gather()
        out = x + self.lin2(torch.tanh(self.lin(x)))
        if self.free and torch.is_grad_enabled():
            self.lin.weight.untyped_storage().resize_(0)
            out.register_hook(lambda grad: (self._gather(), grad)[1])
        return out


class ShardedChain(torch.nn.Module):
    def __init__(self, blocks=6, d=64):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Sharded(d) for _ in range(blocks))
        self.head = torch.nn.Linear(d, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def sharded_batch():
    return torch.randn(256, 64, generator=torch.Generator().manual_seed(0))


def test_freed_parameters_are_never_replayed():
    """A saved tensor whose rebuild would replay an op reading a weight that is freed where
    the rebuild runs (the next block's backward) is kept; what is rebuilt matches eager.
    (Before the profile recorded freed storages, plans at this budget could replay such an
    op: the backward failed reading unallocated storage, or, where the freed weight was
    held as an anchor (the block reaches it through a ``set_`` alias, a value to the
    profile), ``set_`` grew the storage back and the replay read whatever it held: other
    losses than eager, silently.)"""
    from test_auto import compare

    c = compare(ShardedChain, [((sharded_batch(),), {})], 0.7)
    assert c.plan.count("recompute") > 0, c.table()
    profile = c.entry().profile
    assert any(v.absent_statics or v.absent_values for v in profile.values)
    for vid, kind in c.plan.decisions.items():
        if kind != "recompute":
            continue
        value, recipe = profile.values[vid], c.plan.recipes[vid]
        assert not set(recipe.anchors) & value.absent_values
        for i in recipe.ops:
            for ref in profile.ops[i].leaves:
                if getattr(ref, "value", 0) < 0:
                    assert ref.static not in value.absent_statics, profile.ops[i].where


def test_parameter_freed_after_profiling_is_refused_then_profiled_again():
    """The profiled step never freed the weights; a later step does. A rebuild that would
    read a freed weight raises StepDivergedError naming the op and module (never reads the
    freed storage), and the next step is profiled again and runs exactly."""
    torch.manual_seed(0)
    base = ShardedChain()
    for block in base.blocks:
        block.free = False
    # sqrt (segments of about sqrt(n) nodes): a deterministic strategy whose plan rebuilds a
    # block's output from its weight, in the next block's backward.
    model = rt.auto_checkpoint(copy.deepcopy(base), 0.7, strategy="sqrt")
    ref = copy.deepcopy(base)
    x = sharded_batch()
    for step in range(2):  # profiled, then planned
        model(x).backward()
        model.zero_grad(set_to_none=True)
    assert rt.controller(model).plan.count("recompute") > 0
    for block in list(model.blocks) + list(ref.blocks):
        block.free = True
    refused = 0
    for step in range(4):
        ref(x).backward()
        try:
            model(x).backward()
        except rt.StepDivergedError as error:
            assert error.op and error.module and "freed" in str(error)
            refused += 1
        else:
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                assert torch.equal(p.grad, q.grad), n
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    c = rt.controller(model)
    assert refused == 1 and c.reprofiles == 1
    assert c.plan.count("recompute") > 0, c.table()


# ---- torch.compile -------------------------------------------------------------------------

# aot_eager: Dynamo and AOTAutograd as torch.compile runs them, without Inductor's C++ code
# generation (minutes on two cores). What auto_checkpoint does under compile is decided
# while Dynamo traces its forward, whichever backend runs the graph.
BACKEND = "aot_eager"


def test_compiled_model_warns_and_matches_compile_without_remat():
    torch.manual_seed(0)
    base = Net(d=32, layers=2)
    (ids, labels), _ = net_batch()
    torch._dynamo.reset()
    plain = torch.compile(copy.deepcopy(base), backend=BACKEND)
    model = rt.auto_checkpoint(copy.deepcopy(base), 0.5)
    compiled = torch.compile(model, backend=BACKEND)
    eager = copy.deepcopy(base)
    results = []
    for m in (plain, compiled, eager):
        torch.manual_seed(5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = m(ids, labels)
            loss.backward()
        results.append((loss.detach(), [p.grad for p in m.parameters()], caught))
    (l_plain, g_plain, _), (l_remat, g_remat, caught), (l_eager, _, _) = results
    assert any("does not plan inside torch.compile" in str(w.message) for w in caught)
    assert torch.equal(l_remat, l_plain)
    for a, b in zip(g_plain, g_remat):
        assert torch.equal(a, b)
    torch.testing.assert_close(l_remat, l_eager)
    assert not rt.controller(model).entries  # nothing profiled, nothing hooked
    torch._dynamo.reset()


def test_compiled_blocks_inside_a_planned_model_identical():
    """Regional compilation (each block compiled, the model given to auto_checkpoint): the
    plan runs around the compiled blocks, bit-identical to the same compiled blocks without
    remat."""
    from test_auto import compare

    def make():
        model = Net(d=32, layers=2)
        for block in model.blocks:
            block.compile(backend=BACKEND)
        return model

    torch._dynamo.reset()
    c = compare(make, [net_batch()], 0.8)
    assert c.plan.count("recompute") > 0, c.table()
    torch._dynamo.reset()


# ---- a loss computed outside the model ---------------------------------------------------


class LogitsLM(torch.nn.Module):
    """Residual blocks returning logits over a 512-token vocabulary: the loss is the
    caller's (as in torchvision's and most hand-written loops)."""

    def __init__(self, d=32, layers=4, vocab=512):
        super().__init__()
        from test_auto import Block

        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(Block(d, 0.1) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _outside_step(model, ids):
    loss = F.cross_entropy(model(ids).flatten(0, 1), torch.roll(ids, 1, 1).flatten())
    loss.backward()
    return loss


def test_loss_outside_the_model_identical():
    torch.manual_seed(0)
    base = LogitsLM()
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(0))
    eager, model = copy.deepcopy(base), rt.auto_checkpoint(copy.deepcopy(base), 0.6)
    for step in range(3):
        torch.manual_seed(step)
        a = _outside_step(eager, ids)
        torch.manual_seed(step)
        b = _outside_step(model, ids)
        assert torch.equal(a, b), step
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            assert torch.equal(p.grad, q.grad), n
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
    assert rt.controller(model).plan.count("recompute") > 0


def test_loss_outside_the_model_measured_within_predicted():
    torch.manual_seed(0)
    model = rt.auto_checkpoint(LogitsLM(), 0.6)
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        _outside_step(model, ids)
        model.zero_grad(set_to_none=True)
    with rt.StorageTracker() as tracker:
        _outside_step(model, ids)
        model.zero_grad(set_to_none=True)
    entry = rt.controller(model).entry()
    measured = tracker.peak_bytes + entry.static_bytes
    activations = entry.plan.store_all_peak - entry.static_bytes
    # The loss's log_softmax output and the gradients it makes (each as large as the
    # logits) are seen by the profile's outside mode: within the prediction, and close. The
    # logits are returned, so charged as held through the backward (the worst a caller can
    # do: _eager_profile's note 6); this caller drops them, a caller keeping them peaks at
    # the prediction.
    returned = sum(v.nbytes for v in entry.profile.values if v.returned)
    assert measured <= entry.plan.predicted_peak <= measured + returned + activations // 100
    with rt.StorageTracker() as tracker:
        logits = model(ids)
        F.cross_entropy(logits.flatten(0, 1), torch.roll(ids, 1, 1).flatten()).backward()
        model.zero_grad(set_to_none=True)
    kept = tracker.peak_bytes + entry.static_bytes
    assert measured < kept <= entry.plan.predicted_peak <= kept + activations // 100


def test_outside_mode_leaves_the_callers_stack_as_it_found_it():
    """The profiled step's mode watches the caller's loss until the model's backward starts;
    it comes off the caller's dispatch stack at the optimizer's next step, and from under a
    mode the caller entered since at the model's next call, with torch's "a mode is active"
    flag as the caller left it."""
    from torch.utils._python_dispatch import (_get_current_dispatch_mode_stack,
                                              is_in_torch_dispatch_mode)

    torch.manual_seed(0)
    model = rt.auto_checkpoint(LogitsLM(), 0.6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(0))
    _outside_step(model, ids)  # profiled
    assert len(_get_current_dispatch_mode_stack()) == 1  # the outside mode, until released
    opt.step()
    assert _get_current_dispatch_mode_stack() == []
    assert not is_in_torch_dispatch_mode()
    model.zero_grad(set_to_none=True)
    rt.controller(model).entries.clear()
    _outside_step(model, ids)  # profiled again: the mode stays on
    with rt.StorageTracker() as tracker:
        assert _get_current_dispatch_mode_stack()[-1] is tracker
        _outside_step(model, ids)  # planned: takes the outside mode from under the tracker
        assert _get_current_dispatch_mode_stack() == [tracker]
    assert _get_current_dispatch_mode_stack() == []
    assert not is_in_torch_dispatch_mode()
    assert tracker.peak_bytes > 0


def test_no_outside_mode_under_a_callers_mode():
    """A forward called inside the caller's own mode pushes nothing past it (popping it
    later would pop the caller's): the step is profiled as before, and gradients are
    eager's."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    torch.manual_seed(0)
    base = LogitsLM()
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(0))
    eager, model = copy.deepcopy(base), rt.auto_checkpoint(copy.deepcopy(base), 0.6)
    for step in range(2):
        with rt.StorageTracker() as tracker:
            torch.manual_seed(step)
            b = _outside_step(model, ids)
            assert _get_current_dispatch_mode_stack() == [tracker]
        torch.manual_seed(step)
        a = _outside_step(eager, ids)
        assert torch.equal(a, b)
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            assert torch.equal(p.grad, q.grad), n
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
