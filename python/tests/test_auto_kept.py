"""What the caller keeps of a model's output is in the plan (the profile's notes 6 and 7).

``out = model(**batch); out.loss.backward()`` keeps the logits and the key/value cache
transformers returns in train mode alive through the backward; ``model(**batch).loss`` keeps
nothing. A plan is made once per input signature and charges every storage the forward
returns as held to the end of the step, whatever the profiled caller did: so a step peaks
within its prediction whether its caller keeps the output or drops it, and whichever it did
while profiled. Module-checkpoint plans leave out the modules whose re-run in the backward
would change what the caller holds (a cache they append to). GPT-2 and T5 from small
configs (no download), CPU, one thread; measured against predicted with no tolerance, and
losses, gradients, weights, optimizer state and the generator bit-identical to eager.
"""

from __future__ import annotations

import copy
import functools

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import remat.torch as rt  # noqa: E402
from test_auto import assert_identical  # noqa: E402  (the exactness harness)

VOCAB, SEQ, BATCH = 128, 64, 2


def gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=3, n_head=4,
        bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def t5():
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
        dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0)
    return transformers.T5ForConditionalGeneration(config)


def batch_for(name: str, **extra) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    kwargs = {"input_ids": ids, "labels": ids, **extra}
    if name == "t5":
        kwargs["decoder_input_ids"] = torch.roll(ids, 1, 1)
    return kwargs


MODELS = {"gpt2": gpt2, "t5": t5}


def cache_of(out):
    """The key/value cache a transformers output carries (``cache``; older versions:
    ``past_key_values``), or None."""
    return out.get("cache", out.get("past_key_values"))


def cache_tensors(cache) -> list:
    from remat.torch._eager_profile import tensors_in

    return [t.detach().clone() for t in tensors_in(cache)]


def step(model, kwargs, how: str):
    """One training step as a caller writes it: ``keep`` holds the output (its logits and
    cache) through the backward, ``drop`` only the loss. Returns the loss and the cache's
    tensors after the backward (None when dropped)."""
    out = model(**kwargs)
    if how == "keep":
        out.loss.backward()
        return out.loss.detach().clone(), cache_tensors(cache_of(out))
    loss = out.loss
    del out
    loss.backward()
    return loss.detach().clone(), None


def train(model, kwargs, hows, seed=1):
    """AdamW steps, one per entry of ``hows``; everything that must match eager."""
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads, caches = [], [], []
    for how in hows:
        loss, cache = step(model, kwargs, how)
        losses.append(loss)
        caches.append(cache)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {
        "losses": losses, "grads": grads, "caches": caches,
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": [{k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
                for s in opt.state.values()],
        "rng": torch.get_rng_state(),
    }


def assert_same_caches(a, b):
    for x, y in zip(a["caches"], b["caches"]):
        assert (x is None) == (y is None)
        if x is not None:
            assert len(x) == len(y) and all(torch.equal(s, t) for s, t in zip(x, y))


def measured_peak(model, kwargs, how: str) -> int:
    """One step under the storage tracker, plus the static bytes: what the plan predicts."""
    with rt.StorageTracker() as tracker:
        step(model, kwargs, how)
    model.zero_grad(set_to_none=True)
    return tracker.peak_bytes + rt.controller(model).entry().static_bytes


@pytest.mark.parametrize("budget", [0.5, 0.3])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("profiled", ["keep", "drop"])
def test_the_peak_holds_whatever_the_caller_keeps(name, budget, profiled):
    """Profiled with the output kept (or dropped), planned steps that keep it, then drop it:
    each step's measured peak is within the prediction, the prediction within the budget,
    and the whole run (losses, gradients, the cache the caller holds after each backward,
    weights, optimizer state, generator) equals eager's bit for bit."""
    kwargs = batch_for(name)
    hows = [profiled, "keep", "drop", "keep"]
    torch.manual_seed(0)
    base = MODELS[name]().train()
    eager = train(copy.deepcopy(base), kwargs, hows)
    model = rt.auto_checkpoint(copy.deepcopy(base), budget)
    planned = train(model, kwargs, hows)
    assert_identical(eager, planned)
    assert_same_caches(eager, planned)
    assert any(c is not None and c for c in planned["caches"]), "no cache was returned"
    control = rt.controller(model)
    plan = control.plan
    assert plan.count("recompute") > 0, control.table()
    assert plan.predicted_peak <= plan.budget_bytes
    profile = control.entry().profile
    returned = [v for v in profile.values if v.returned]
    assert returned and all(v.held_outside and not v.recomputable for v in returned)
    assert all(plan.decisions.get(v.id, "keep") == "keep" for v in returned)
    for how in ("keep", "drop", "keep"):
        peak = measured_peak(model, kwargs, how)
        assert peak <= plan.predicted_peak, (how, peak, plan.predicted_peak)
    assert "kept by the caller" in control.table()


def test_without_a_cache_the_output_kept_is_still_counted():
    """``use_cache=False``: the logits the caller keeps are the returned storage charged
    through the step; a dropped output peaks lower, never above the prediction."""
    kwargs = batch_for("gpt2", use_cache=False)
    torch.manual_seed(0)
    model = rt.auto_checkpoint(gpt2().train(), 0.3)
    for how in ("drop", "drop"):
        step(model, kwargs, how)
        model.zero_grad(set_to_none=True)
    plan = rt.controller(model).plan
    kept = measured_peak(model, kwargs, "keep")
    dropped = measured_peak(model, kwargs, "drop")
    assert dropped < kept <= plan.predicted_peak <= plan.budget_bytes


def checkpointed(forward, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def test_a_block_rerun_by_checkpoint_appends_to_the_callers_cache():
    """Why checkpoint plans leave cache-writing modules out: ``torch.utils.checkpoint``
    around a GPT-2 block re-runs its forward in the backward, and the block's attention
    appends its keys to the ``DynamicCache`` the caller holds a second time (its length
    doubles, silently). The profile names every module whose forward changed an object it
    was given; a module that only makes the cache (the whole ``transformer``: a re-run makes
    a fresh one) is not among them."""
    kwargs = batch_for("gpt2")
    torch.manual_seed(0)
    model = gpt2().train()
    block = model.transformer.h[0]
    block.forward = functools.partial(checkpointed, block.forward)
    out = model(**kwargs)
    assert cache_of(out).layers[0].keys.shape[-2] == SEQ
    out.loss.backward()
    assert cache_of(out).layers[0].keys.shape[-2] == 2 * SEQ  # the re-run appended
    del block.forward

    torch.manual_seed(0)
    model = rt.auto_checkpoint(gpt2().train(), 1.0)
    step(model, kwargs, "keep")
    writes = rt.controller(model).entries[next(iter(rt.controller(model).entries))] \
        .profile.module_writes
    for i in range(3):
        assert f"transformer.h.{i}" in writes and f"transformer.h.{i}.attn" in writes
        assert "Cache" in writes[f"transformer.h.{i}.attn"]
    assert "transformer" not in writes and f"transformer.h.0.mlp" not in writes


@pytest.mark.parametrize("name", list(MODELS))
def test_checkpoint_plans_are_offered_beside_a_returned_cache(name):
    """With the cache returned (transformers' default in train mode), ``strategy=
    "checkpoint"`` finds a plan of checkpointed modules: none of them changes the cache or
    saves a tensor the caller holds; it runs bit-identical to eager, the cache after each
    backward is eager's, and the measured peak is within the prediction."""
    from remat.torch._eager_segments import _rerun_changes

    kwargs = batch_for(name)
    hows = ["keep", "keep", "drop"]
    torch.manual_seed(0)
    base = MODELS[name]().train()
    eager = train(copy.deepcopy(base), kwargs, hows)
    model = rt.auto_checkpoint(copy.deepcopy(base), 0.8, strategy="checkpoint")
    planned = train(model, kwargs, hows)
    assert_identical(eager, planned)
    assert_same_caches(eager, planned)
    control = rt.controller(model)
    plan = control.plan
    assert plan.checkpoint_modules, control.table()
    profile = control.entry().profile
    assert profile.module_writes
    assert not any(_rerun_changes(profile, m) for m in plan.checkpoint_modules)
    for how in ("keep", "drop"):
        assert measured_peak(model, kwargs, how) <= plan.predicted_peak <= plan.budget_bytes
