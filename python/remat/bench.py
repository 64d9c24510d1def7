"""``python -m remat.bench``: remat's ``auto_checkpoint`` against PyTorch's own options, side by side.

Models come from their libraries, randomly initialised from configs built here (nothing is
downloaded; the decoders with ``use_cache=False``, as training runs them: with the key/value
cache on, every layer's keys and values stay in the output's cache, which no contender but
``ckpt-block`` (transformers turns the cache off there) can drop): transformers' ``LlamaForCausalLM``, ``GPT2LMHeadModel`` and ``BertForMaskedLM``
(given an ``attention_mask`` whose second sequence is padded), torchvision's ``resnet50`` and
a ``vit_b_16``-style ``VisionTransformer`` (patch 16 at 224 px, narrower and shallower than
B/16 so that a CPU runs it; dropout 0.1). ``--small`` builds tiny ones; ``--device cuda``
trains them on a GPU (CPU by default). Every contender
trains the same model from the same weights, one ordinary step at a time
(``loss.backward()``):

- ``none``: plain eager, nothing recomputed;
- ``ckpt-block``: ``torch.utils.checkpoint`` (non-reentrant) around every block
  (transformers' own ``activation_checkpointing_enable`` for its models);
- ``compile@f``: ``torch.compile`` with ``torch._functorch.config.activation_memory_budget =
  f`` (the min-cut partitioner's knapsack). The backend is AOTAutograd with that
  partitioner and graphs run op by op (as ``aot_eager``): on CPU, Inductor's code
  generation would take most of the run, and op-by-op execution times the same aten
  kernels as the other contenders;
- ``offload-all``: every tensor autograd saves goes through ``saved_tensors_hooks`` to the
  host, as torchtune and torchao offload activations: ``torch.autograd.graph.save_on_cpu``
  (pinned host buffers on CUDA). On a CPU device the host is the device's own memory, so it
  saves nothing there (the hooks run, the tensors stay where they are); it is run anyway;
- ``remat@f``: ``remat.torch.auto_checkpoint(model, f)``, a fraction f of the step's
  activation bytes (``remat@1.0`` always: the plan keeps everything and the step runs
  unhooked, so it must cost what ``none`` does; the goal is within 2%);
- ``remat=X``, for each contender X that saves memory another way (``ckpt-block``,
  ``compile@f``, ``offload-all``): ``auto_checkpoint`` with a byte budget equal to X's
  *measured* peak: the plan's static bytes (parameters, buffers and inputs the step reads)
  + X's measured activation peak, plus 0.1% of it (remat's predictions err on the safe
  side by a few hundred bytes; the verdict compares measured peaks). If remat's measured
  peak comes out above X's, it re-plans once lower by the excess. These rows are the ones
  the goal is read from: at equal measured memory, is remat's step slower?

remat's contenders each train their own copy of the model (``auto_checkpoint`` keeps one
plan per model). The first step of each is plain eager while remat profiles it; the second
plans and runs the plan; the table below the timings shows, per remat contender, the
strategy, the predicted peak against the measured one, the planning time and that first
(profiled) step's time.

Activation peak, measured the same way for every contender: on CPU, every storage created
during the step (outputs of every aten op: a dispatch mode for eager code, including the
ops remat replays in the backward and those of save-tensor hooks; the compiled graphs'
interpreters for ``torch.compile``) is tracked with a weak reference, and after each op the
bytes of those still alive are summed; the peak of that sum is reported (activations,
gradients and the loss; not parameters, buffers or inputs). On CUDA,
``torch.cuda.max_memory_allocated`` above the step's starting level.

Step time, measured without the memory tracking, in ``--runs`` interleaved rounds: each
round runs one step of every contender (the order rotating), so that the drift of a shared
machine falls on all alike; a contender's step time is its median, its ratio to ``none``
the median of the per-round ratios, and each equal-memory pairing's ratio the median of
the per-round remat / contender ratios, with their median absolute deviation as the noise.
"""

from __future__ import annotations

__all__ = ["main", "bench_case", "Case", "llama", "llama_large", "gpt2", "bert", "resnet50",
           "vit", "LiveBytes", "Contender", "Row", "time_interleaved", "format_table",
           "format_remat_table", "pairing_verdicts", "full_budget_verdict"]

import argparse
import contextlib
import copy
import dataclasses
import gc
import statistics
import sys
import time
import types
from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

F = torch.nn.functional
MiB = 2**20
# remat@1.0 may cost this much more than `none` (the goal at full budget).
FULL_BUDGET_GOAL = 1.02


# ---- models -------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    """One model's training step as every contender runs it: the model, its inputs, how its
    loss is computed, and how to switch ``torch.utils.checkpoint`` per block on and off (the
    ``ckpt-block`` contender). The builders in ``MODELS`` make them; any model can be one:

    >>> import torch, torch.nn.functional as F
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    >>> x, y = torch.randn(4, 8), torch.randn(4, 8)
    >>> case = Case("mlp", net, (x, y), lambda m, x, y: F.mse_loss(m(x), y),
    ...             enable_block_checkpoint=lambda: None, disable_block_checkpoint=lambda: None)
    >>> case.loss().shape
    torch.Size([])
    """

    name: str
    model: torch.nn.Module
    inputs: Any  # dict of keyword inputs (output has .loss) or tuple of positional ones
    loss_fn: Callable | None  # loss_fn(model, *inputs) for positional inputs
    enable_block_checkpoint: Callable[[], None]
    disable_block_checkpoint: Callable[[], None]
    autocast: torch.dtype | None = None  # the forward under torch.autocast to this dtype

    def loss(self, model: torch.nn.Module | None = None):
        """The step's loss from ``model`` (default: the case's own model), under autocast
        when the case asks for it."""
        model = self.model if model is None else model
        if self.autocast is None:
            return self._loss(model)
        device = next(model.parameters()).device.type
        with torch.autocast(device, dtype=self.autocast):
            return self._loss(model)

    def _loss(self, model: torch.nn.Module):
        if isinstance(self.inputs, dict):
            return model(**self.inputs).loss
        return self.loss_fn(model, *self.inputs)


def _hf_checkpointing(model):
    # transformers 5 names it activation checkpointing; older releases, gradient.
    new = hasattr(model, "activation_checkpointing_enable")

    def enable():
        if new:
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def disable():
        if new:
            model.activation_checkpointing_disable()
        else:
            model.gradient_checkpointing_disable()
        # enable() also hooks the embeddings to make their output require grad.
        if getattr(model, "_require_grads_hook", None) is not None:
            model.disable_input_require_grads()

    return enable, disable


def llama(small: bool) -> Case:
    """transformers' ``LlamaForCausalLM`` from a random config (nothing downloaded), without
    its key/value cache, with token ids as inputs and labels; ``small``: 4 layers of width
    64 over 128 tokens, else 8 of width 512 over 256.

    >>> llama(small=True).name
    'llama-4x64'
    """
    import transformers

    layers, d, ffn, heads, vocab, batch, seq = (
        (4, 64, 172, 4, 256, 2, 128) if small else (8, 512, 1376, 8, 4096, 2, 256))
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=d, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=2 * seq,
        use_cache=False)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, vocab, (batch, seq))
    return Case(f"llama-{layers}x{d}", model, {"input_ids": ids, "labels": ids}, None,
                *_hf_checkpointing(model))


def llama_large(small: bool) -> Case:
    """A Llama where activations dominate, the size the GPU rows are measured at: 16 layers,
    hidden 2048, sequence 4096, one sequence per step (``--small``: 4 layers, hidden 256,
    sequence 512). Meant for ``--device cuda --autocast bf16``; on a CPU it is slow.

    >>> case = llama_large(small=True)
    >>> case.name, tuple(case.inputs["input_ids"].shape)
    ('llama-4x256-s512', (1, 512))
    """
    import transformers

    layers, d, ffn, heads, vocab, batch, seq = (
        (4, 256, 688, 4, 1024, 1, 512) if small else (16, 2048, 5504, 16, 32000, 1, 4096))
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=d, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq,
        use_cache=False)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, vocab, (batch, seq))
    return Case(f"llama-{layers}x{d}-s{seq}", model, {"input_ids": ids, "labels": ids}, None,
                *_hf_checkpointing(model))


def gpt2(small: bool) -> Case:
    """transformers' ``GPT2LMHeadModel`` from a random config, without its key/value cache;
    ``small``: 4 layers of width 64 over 128 tokens, else width 512 over 256.

    >>> gpt2(small=True).name
    'gpt2-4x64'
    """
    import transformers

    layers, d, heads, vocab, batch, seq = (
        (4, 64, 4, 256, 2, 128) if small else (4, 512, 8, 4096, 2, 256))
    config = transformers.GPT2Config(vocab_size=vocab, n_embd=d, n_layer=layers, n_head=heads,
                                     n_positions=2 * seq, bos_token_id=vocab - 1,
                                     eos_token_id=vocab - 1, use_cache=False)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, vocab, (batch, seq))
    return Case(f"gpt2-{layers}x{d}", model, {"input_ids": ids, "labels": ids}, None,
                *_hf_checkpointing(model))


def bert(small: bool) -> Case:
    """Masked LM with the usual call: an ``attention_mask`` whose last sequence is padded
    over its last quarter, and labels ignored (-100) there.

    >>> case = bert(small=True)
    >>> case.name, int(case.inputs["attention_mask"][-1].sum())
    ('bert-4x64-padded', 96)
    """
    import transformers

    layers, d, ffn, heads, vocab, batch, seq = (
        (4, 64, 256, 4, 256, 2, 128) if small else (4, 512, 2048, 8, 4096, 2, 256))
    config = transformers.BertConfig(vocab_size=vocab, hidden_size=d, num_hidden_layers=layers,
                                     num_attention_heads=heads, intermediate_size=ffn,
                                     max_position_embeddings=2 * seq)
    model = transformers.BertForMaskedLM(config).train()
    ids = torch.randint(0, vocab, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, seq - seq // 4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return Case(f"bert-{layers}x{d}-padded", model, inputs, None, *_hf_checkpointing(model))


class _Checkpointed(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def _block_checkpointing(containers: list[torch.nn.Module]):
    """enable / disable that swap every block of ``containers`` (indexable modules) for a
    checkpointed wrapper of it, and back."""
    originals = [list(c) for c in containers]

    def enable():
        for container, blocks in zip(containers, originals):
            for i, block in enumerate(blocks):
                container[i] = _Checkpointed(block)

    def disable():
        for container, blocks in zip(containers, originals):
            for i, block in enumerate(blocks):
                container[i] = block

    return enable, disable


def _classification_loss(m, x, y):
    return F.cross_entropy(m(x), y)


def resnet50(small: bool) -> Case:
    """torchvision's ``resnet50`` (100 classes, random weights) on random images; ``small``:
    2 images of 32 px, else 4 of 112 px. ``ckpt-block`` checkpoints each of its four stages.

    >>> resnet50(small=True).name
    'resnet50-32px'
    """
    import torchvision

    batch, side = (2, 32) if small else (4, 112)
    model = torchvision.models.resnet50(num_classes=100).train()
    x = torch.randn(batch, 3, side, side)
    y = torch.randint(0, 100, (batch,))
    stages = [model.layer1, model.layer2, model.layer3, model.layer4]
    return Case(f"resnet50-{side}px", model, (x, y), _classification_loss,
                *_block_checkpointing(stages))


def vit(small: bool) -> Case:
    """torchvision's ``VisionTransformer`` as ``vit_b_16`` builds it (patch 16, 224 px), with
    fewer and narrower layers; ``--small``: 32 px images in patches of 4.

    >>> vit(small=True).name
    'vit-4x64-p4'
    """
    import torchvision

    side, patch, layers, heads, d, mlp, batch = (
        (32, 4, 4, 4, 64, 256, 8) if small else (224, 16, 4, 4, 256, 1024, 2))
    model = torchvision.models.VisionTransformer(
        image_size=side, patch_size=patch, num_layers=layers, num_heads=heads, hidden_dim=d,
        mlp_dim=mlp, dropout=0.1, attention_dropout=0.1, num_classes=100).train()
    x = torch.randn(batch, 3, side, side)
    y = torch.randint(0, 100, (batch,))
    return Case(f"vit-{layers}x{d}-p{patch}", model, (x, y), _classification_loss,
                *_block_checkpointing([model.encoder.layers]))


MODELS = {"llama": llama, "gpt2": gpt2, "bert": bert, "resnet50": resnet50, "vit": vit,
          "llama-large": llama_large}
# What runs when --models is not given (llama-large is for a GPU).
AUTOCAST = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_MODELS = ("llama", "gpt2", "bert", "resnet50", "vit")
METHODS = ("ckpt", "compile", "offload", "remat")


# ---- measuring ----------------------------------------------------------------------------


class LiveBytes:
    """Bytes of the storages made during a step that are still alive, sampled after every
    op that records its outputs here; ``peak`` is the largest sample. ``existing``: storages
    that were there before the step (parameters, buffers, inputs), which op outputs may
    alias (``t(weight)``, ``detach``) but which the step did not make.

    >>> import torch
    >>> live = LiveBytes()
    >>> a = torch.zeros(256)            # 1 KiB of float32
    >>> live.record(a)
    >>> b = torch.zeros(512); live.record(b)
    >>> del a; live.record(b)           # a's storage is gone at the next sample
    >>> live.peak, live.live
    (3072, 2048)
    """

    def __init__(self, existing: set[int] = frozenset()):
        self.existing = set(existing)
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.live = 0
        self.peak = 0

    def record(self, out) -> None:
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            s = t.untyped_storage()
            ptr, nbytes = s.data_ptr(), s.nbytes()
            if nbytes == 0 or ptr in self.existing:
                continue
            known = self.refs.get(ptr)
            if known is None or known[0].expired():
                self.refs[ptr] = (StorageWeakRef(s), nbytes)
        dead = [p for p, (ref, _) in self.refs.items() if ref.expired()]
        for p in dead:
            del self.refs[p]
        self.live = sum(n for _, n in self.refs.values())
        self.peak = max(self.peak, self.live)


class _Recording(TorchDispatchMode):
    def __init__(self, live: LiveBytes):
        super().__init__()
        self.live = live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live.record(out)
        return out


# The LiveBytes the compiled graphs report to while a memory run is on (None otherwise).
_COMPILED_LIVE: list[LiveBytes | None] = [None]


def _counting_compiler(gm: torch.fx.GraphModule, _example_inputs):
    """Runs a compiled (forward or backward) graph op by op, reporting every op's output
    to the memory run in progress, if any."""

    class Counting(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            live = _COMPILED_LIVE[0]
            if live is not None and n.op == "call_function":
                live.record(out)
            return out

    from functorch.compile import make_boxed_func

    def run(*args):
        return Counting(gm).run(*args)

    return make_boxed_func(run)


def _compile_backend(counter: list[int]):
    """AOTAutograd with the min-cut partitioner, graphs run op by op; ``counter[0]`` counts
    the forward graphs compiled."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def forward_compiler(gm, example_inputs):
        counter[0] += 1
        return _counting_compiler(gm, example_inputs)

    return aot_autograd(fw_compiler=forward_compiler, bw_compiler=_counting_compiler,
                        partition_fn=min_cut_rematerialization_partition,
                        keep_inference_input_mutations=True)


@dataclasses.dataclass
class RematInfo:
    """What one remat contender was given and planned."""

    budget: int | float  # what auto_checkpoint was given (bytes, or a fraction)
    plan: Any  # remat.torch's plan (predicted_peak, static_bytes, strategy, ...)
    profile_s: float  # the first step: plain eager while remat profiles it
    plan_s: float  # planning, at the start of the second step
    replanned: int = 0  # bytes the budget was lowered by after a measured peak above it


@dataclasses.dataclass
class Contender:
    """One way to run the training step. ``step`` runs it; ``enter`` / ``leave`` (untimed)
    put the model into and out of the state it needs (checkpointing wrappers). ``model``:
    the model the step trains when it is not the case's own (remat's copies).

    >>> c = Contender("none", step=lambda: None)
    >>> c.step(); c.times
    []
    """

    method: str
    step: Callable[[], Any]
    enter: Callable[[], None] = lambda: None
    leave: Callable[[], None] = lambda: None
    uses_mode: bool = True  # its ops run in eager code, visible to a dispatch mode
    peak: int = 0
    times: list[float] = dataclasses.field(default_factory=list)
    note: str = ""
    pair: str | None = None  # remat's equal-memory rows: the contender they are paired with
    model: torch.nn.Module | None = None
    remat: RematInfo | None = None
    alias: bool = False  # another contender's steps under this name: not timed again


@dataclasses.dataclass
class Row:
    """One line of the main table: a contender's measured activation peak (bytes), median
    step time (seconds), its ratio to ``none`` (median of per-round ratios, with the median
    absolute deviation as ``ratio_spread``) and, for remat's equal-memory rows, the same
    against the contender it is paired with.

    >>> Row("llama-4x64", "none", 2**20, 0.05, ratio=1.0).method
    'none'
    """

    model: str
    method: str
    peak: int
    step_s: float
    note: str = ""
    ratio: float = float("nan")  # median over rounds of (this step / none's step)
    ratio_spread: float = float("nan")  # median absolute deviation of those ratios
    pair: str | None = None
    pair_ratio: float = float("nan")  # median over rounds of (this step / pair's step)
    pair_spread: float = float("nan")  # median absolute deviation of those ratios
    remat: RematInfo | None = None


def _zero(model):
    for p in model.parameters():
        p.grad = None


def _existing_storages(model: torch.nn.Module, inputs) -> set[int]:
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    return {t.untyped_storage().data_ptr() for t in tensors}


def _measure_peak(c: Contender, case: Case, device, warm_up: bool = True) -> int:
    """Activation peak in bytes of one step of ``c`` (after an untimed warm-up step, unless
    the caller has run its first steps already)."""
    c.enter()
    try:
        if warm_up:
            c.step()  # lazy initialisation is not anyone's memory
        if device.type == "cuda":
            # The step starts by dropping the last step's gradients: they are not above the
            # base, the new ones are.
            _zero(c.model or case.model)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            c.step()
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device) - base
        # Non-reentrant checkpointing leaves reference cycles: collect them first, so that
        # one contender's garbage is not counted against the next.
        gc.collect()
        live = LiveBytes(_existing_storages(c.model or case.model, case.inputs))
        _COMPILED_LIVE[0] = live
        try:
            if c.uses_mode:
                with _Recording(live):
                    c.step()
            else:
                c.step()
        finally:
            _COMPILED_LIVE[0] = None
        return live.peak
    finally:
        c.leave()
        _zero(c.model or case.model)


def time_interleaved(contenders: list[Contender], rounds: int, device,
                     model: torch.nn.Module | None = None) -> None:
    """Times ``rounds`` rounds of one step of each contender (the first untimed, a warm-up),
    rotating the order each round, so that drift of the shared machine (other processes,
    frequency) falls on all of them alike; appends each step's seconds to ``times``. After
    each step (untimed) the gradients of the contender's model (``model`` for those that
    train the case's own) are dropped, so that a GPU holds one set of them, not one per
    copy.

    >>> import torch
    >>> fast, slow = Contender("fast", lambda: None), Contender("slow", lambda: sum(range(10**4)))
    >>> time_interleaved([fast, slow], rounds=3, device=torch.device("cpu"))
    >>> len(fast.times), len(slow.times)
    (3, 3)
    """
    n = len(contenders)
    for r in range(rounds + 1):
        for k in range(n):
            c = contenders[(r + k) % n]
            c.enter()
            gc.collect()  # a contender's reference cycles are not the next one's time
            t0 = time.perf_counter()
            c.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - t0
            c.leave()
            if c.model is not None or model is not None:
                _zero(c.model if c.model is not None else model)
            if r > 0:
                c.times.append(elapsed)


@dataclasses.dataclass
class Overlap:
    """Host-device copies of one CUDA step against its compute kernels, from the profiler's
    device timeline: ``copy_s`` the copies' time, ``hidden_s`` the part of it during which
    some kernel ran (the copy overlapped compute), ``kernel_s`` the kernels' busy time."""

    copies: int
    copy_s: float
    hidden_s: float
    kernel_s: float

    def describe(self) -> str:
        if not self.copies:
            return "no host copies seen"
        share = self.hidden_s / self.copy_s if self.copy_s else 1.0
        return (f"{self.copies} copies, {self.copy_s * 1e3:.1f} ms copying, {share:.0%} of it under compute; kernels busy "
                f"{self.kernel_s * 1e3:.1f} ms")


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _covered(span: tuple[int, int], union: list[tuple[int, int]]) -> int:
    return sum(max(0, min(span[1], e) - max(span[0], s)) for s, e in union)


def copy_overlap(c: Contender, model: torch.nn.Module) -> Overlap | str:
    """One step of ``c`` under ``torch.profiler`` with CUDA activity: how much of its
    host-device copy time ran while a compute kernel did (the offload's overlap)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        c.enter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            c.step()
            torch.cuda.synchronize()
        c.leave()
        _zero(c.model if c.model is not None else model)
        events = prof.profiler.kineto_results.events()
    except Exception as error:  # noqa: BLE001 - reported, the bench goes on
        return f"profiler failed: {type(error).__name__}: {error}"
    kernels, copies = [], []
    for e in events:
        if e.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        span = (e.start_ns(), e.start_ns() + e.duration_ns())
        name = e.name()
        if name.startswith("Memcpy DtoH") or name.startswith("Memcpy HtoD"):
            copies.append(span)
        elif not name.startswith("Memcpy") and not name.startswith("Memset"):
            kernels.append(span)
    busy = _union(kernels)
    return Overlap(len(copies), sum(e - s for s, e in copies) / 1e9,
                   sum(_covered(sp, busy) for sp in copies) / 1e9,
                   sum(e - s for s, e in busy) / 1e9)


def _median_ratio(a: list[float], b: list[float]) -> tuple[float, float]:
    """Median of the per-round ratios a[i] / b[i], and their median absolute deviation."""
    ratios = [x / y for x, y in zip(a, b) if y > 0]
    if not ratios:
        return float("nan"), float("nan")
    mid = statistics.median(ratios)
    return mid, statistics.median(abs(x - mid) for x in ratios)


# ---- contenders ---------------------------------------------------------------------------


def _eager_step(case: Case) -> Callable[[], None]:
    def step():
        _zero(case.model)
        case.loss().backward()

    return step


def _offload_contender(case: Case, device) -> Contender:
    """Every saved tensor through ``save_on_cpu``: pinned host buffers on CUDA; on CPU the
    tensors stay where they are (``.cpu()`` of a CPU tensor is itself)."""
    pin = device.type == "cuda"

    def step():
        _zero(case.model)
        with torch.autograd.graph.save_on_cpu(pin_memory=pin):
            loss = case.loss()
        loss.backward()

    note = ("save_on_cpu(pin_memory=True)" if pin else
            "save_on_cpu: on CPU the host is the device's memory, so this saves nothing "
            "(hooks only)")
    return Contender("offload-all", step, note=note)


def _compile_contenders(case: Case, budgets: list[float], counter: list[int]) -> list[Contender]:
    """One ``torch.compile`` per budget, each compiled while its budget is set. Each gets its
    own code object, so that Dynamo's cache (per code object) keeps all of them at once and
    they can be timed in the same rounds; ``counter`` counts the graphs compiled, which
    shows a recompile during timing."""
    backend = _compile_backend(counter)
    out = []
    for i, f in enumerate(budgets):
        def loss():
            return case.loss()

        code = loss.__code__.replace(co_name=f"bench_loss_{i}")
        fresh = types.FunctionType(code, loss.__globals__, code.co_name, None, loss.__closure__)
        compiled = torch.compile(fresh, backend=backend)

        def compiled_step(compiled=compiled, f=f):
            # Set at every call, not only the first: a guard that fails (the checkpointing
            # contender changes the model's attributes) recompiles under this budget.
            old = torch._functorch.config.activation_memory_budget
            torch._functorch.config.activation_memory_budget = f
            try:
                _zero(case.model)
                compiled().backward()
            finally:
                torch._functorch.config.activation_memory_budget = old

        method = f"compile@{f}"
        try:
            t0 = time.perf_counter()
            before = counter[0]
            compiled_step()
            graphs = counter[0] - before
            note = f"compile {time.perf_counter() - t0:.1f} s, {graphs} graphs"
            if graphs == 0 and i > 0:
                # A graph break leaves the model's own code in Dynamo's cache, shared by all
                # the compiled steps: this one runs graphs partitioned at an earlier budget.
                note += " (reuses an earlier budget's graphs: graph break)"
            out.append(Contender(method, compiled_step, uses_mode=False, note=note))
        except Exception as error:  # noqa: BLE001 - reported in the table
            out.append(Contender(method, compiled_step, uses_mode=False,
                                 note=f"failed: {type(error).__name__}: {str(error)[:80]}"))
    return out


class _Remat:
    """Makes remat contenders: each trains its own copy of the case's model under
    ``auto_checkpoint``."""

    def __init__(self, case: Case, template: torch.nn.Module, device, bandwidth: float | None,
                 time_limit: float | None):
        self.case = case
        self.template = template  # the model as it was before any contender ran
        self.device = device
        self.options = {"bandwidth": bandwidth, "time_limit": time_limit}
        self.static: int | None = None  # the plans' static bytes, once one is made

    def contender(self, method: str, budget: int | float,
                  above_device: int | None = None) -> Contender:
        """``above_device``: on CUDA, the budget is what the device holds once this copy is
        there (every other contender's model too: a CUDA budget is the device's own count)
        plus these bytes."""
        import remat.torch as rt

        template = copy.deepcopy(self.template)
        if above_device is not None:
            torch.cuda.synchronize(self.device)
            budget = torch.cuda.memory_allocated(self.device) + above_device
        model = rt.auto_checkpoint(template, budget, **self.options)
        case = self.case

        def step():
            _zero(model)
            case.loss(model).backward()

        c = Contender(method, step, model=model)
        self.plan(c, budget)
        return c

    def plan(self, c: Contender, budget: int | float) -> None:
        """Gives ``c``'s model ``budget`` (dropping any earlier plan), runs the profiled
        first step and the planning second one, and measures the peak of the third; on a
        budget no plan meets, ``c`` stays unmeasured with the reason in its note."""
        import remat
        import remat.torch as rt

        c.peak, c.remat = 0, None
        rt.auto_checkpoint(c.model, budget)
        try:
            gc.collect()
            t0 = time.perf_counter()
            c.step()
            profile_s = time.perf_counter() - t0
            c.step()
        except remat.BudgetError as error:
            c.note = _infeasible(error, self.static)
            return
        except Exception as error:  # noqa: BLE001 - reported in the table
            c.note = f"failed: {type(error).__name__}: {str(error)[:100]}"
            return
        control = rt.controller(c.model)
        plan = control.plan
        if self.static is None:
            self.static = plan.static_bytes
        c.remat = RematInfo(budget, plan, profile_s, control.entry().plan_seconds)
        kept = "keeps everything (unhooked)" if plan.keeps_everything else (
            f"{plan.count('recompute')} recomputed, {plan.count('offload')} offloaded")
        c.note = f"{plan.strategy}: {kept}, predicted +{plan.overhead * 100:.1f}%"
        c.peak = _measure_peak(c, self.case, self.device, warm_up=False)

    def equal_memory(self, target: Contender, static: int) -> Contender:
        """remat at ``target``'s measured peak. The budget allows 0.1% above it, as the
        predictions err on the safe side by a few hundred bytes (a tensor rebuilt under
        ``torch.utils.checkpoint`` can leave before its node's end); the verdict compares
        measured peaks. Memory the plan does not see (an op's scratch) can take the measured
        peak above the predicted one; then it re-plans once, lower by the excess, so that
        the pairing is at equal measured memory."""
        budget = static + target.peak + target.peak // 1000
        above = target.peak if self.device.type == "cuda" else None
        c = self.contender(f"remat={target.method}", budget, above)
        budget = c.remat.budget if c.remat is not None else budget
        if c.peak > target.peak:
            excess = c.peak - target.peak
            self.plan(c, static + target.peak - excess)
            if c.remat is not None:
                c.remat.replanned = excess
                c.note += f"; re-planned {excess / MiB:.2f} MiB lower"
        c.pair = target.method
        return c


def _same_as(full: Contender, target: Contender) -> Contender:
    """remat at ``target``'s measured peak when that is no less than remat@1.0's: the plan
    that keeps everything fits, so the pairing is remat@1.0 itself (its steps, its times)."""
    return dataclasses.replace(full, method=f"remat={target.method}", pair=target.method,
                               alias=True, times=full.times, note=f"= {full.method}: {target.method} holds "
                               f"no less than keeping everything")


def _infeasible(error, static: int | None) -> str:
    """The reason a budget has no plan, in the table's terms (bytes above the static ones)
    when the static bytes are known."""
    best, budget = getattr(error, "best_peak", None), getattr(error, "budget_bytes", None)
    if best is None or budget is None:
        return f"infeasible: {error}"
    if static is None:
        return (f"infeasible: remat's least peak is {best / MiB:.2f} MiB (static bytes "
                f"included), above the budget's {budget / MiB:.2f} MiB")
    return (f"infeasible: remat's least peak is {(best - static) / MiB:.2f} MiB, above the "
            f"budget's {(budget - static) / MiB:.2f} MiB")


class _Phases:
    """Wall seconds per phase of a model's bench (summed over its visits)."""

    def __init__(self, seconds: dict[str, float]):
        self.seconds = seconds

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def _remat_contenders(case: Case, template, contenders: list[Contender], budgets: list[float],
                      device, bandwidth, time_limit, info: dict) -> list[Contender]:
    """remat@1.0, remat@f for each budget, then remat=X for each contender X that saves
    memory, at X's measured peak."""
    maker = _Remat(case, template, device, bandwidth, time_limit)
    others = [c for c in contenders if c.method != "none" and c.peak > 0]
    fractions = [1.0] + [f for f in budgets if f != 1.0]
    planned = [maker.contender(f"remat@{f}", f) for f in fractions]
    static = maker.static
    info["static_bytes"] = static
    if static is None:
        return planned
    full = planned[0]
    for target in others:
        if 0 < full.peak <= target.peak:
            planned.append(_same_as(full, target))
        else:
            planned.append(maker.equal_memory(target, static))
    return planned


def bench_case(case: Case, budgets: list[float], runs: int, methods: set[str],
               bandwidth: float | None = None,
               time_limit: float | None = None) -> tuple[list[Row], dict]:
    """Every contender on one case: ``none`` always, and those of ``methods`` (``ckpt``,
    ``compile``, ``offload``, ``remat``) at the activation fractions ``budgets``; their
    activation peaks, then ``runs`` interleaved rounds of step times. Returns one
    :class:`Row` per contender (``format_table`` prints them) and remat's planning details.
    ``bandwidth`` and ``time_limit`` go to ``auto_checkpoint``.

    >>> import torch
    >>> torch.manual_seed(0) is not None
    True
    >>> rows, info = bench_case(llama(small=True), [0.5], runs=1, methods={"ckpt"})
    >>> [r.method for r in rows]
    ['none', 'ckpt-block']
    """
    # The collections between steps (reference cycles of checkpointing) would otherwise walk
    # every object torch and transformers made at import, 0.5 s a time on a busy host: what
    # is there now is left out of them until the case is done.
    gc.collect()
    gc.freeze()
    try:
        return _bench_case(case, budgets, runs, methods, bandwidth, time_limit)
    finally:
        gc.unfreeze()


def _bench_case(case: Case, budgets: list[float], runs: int, methods: set[str],
                bandwidth: float | None, time_limit: float | None) -> tuple[list[Row], dict]:
    model = case.model
    device = next(model.parameters()).device
    info: dict = {"phases": {}}
    phase = _Phases(info["phases"])
    eager = _eager_step(case)
    eager()  # the first step pays for lazy initialisation: not anyone's time
    _zero(model)
    template = copy.deepcopy(model)  # remat's copies start from here, unwrapped, same weights
    contenders = [Contender("none", eager)]
    if "ckpt" in methods:
        contenders.append(Contender("ckpt-block", eager, case.enable_block_checkpoint,
                                    case.disable_block_checkpoint))
    with phase("measure"):
        # Before compiling: turning checkpointing on and off leaves attributes behind
        # (transformers' flags) that would fail the compiled graphs' guards once.
        for c in contenders:
            c.peak = _measure_peak(c, case, device)
    counter = [0]
    later = []
    if "compile" in methods:
        with phase("compile"):
            torch._dynamo.reset()
            later += _compile_contenders(case, budgets, counter)
    compiled = counter[0]
    if "offload" in methods:
        later.append(_offload_contender(case, device))
    with phase("measure"):
        for c in later:
            if not c.note.startswith("failed"):
                c.peak = _measure_peak(c, case, device)
    contenders += later

    if "remat" in methods:
        with phase("remat"):
            contenders += _remat_contenders(case, template, contenders, budgets, device,
                                            bandwidth, time_limit, info)

    timed = [c for c in contenders if c.peak > 0 and not c.alias]
    with phase("timing"):
        time_interleaved(timed, runs, device, model)
    if device.type == "cuda":
        with phase("overlap"):
            info["overlap"] = [(c.method, copy_overlap(c, model)) for c in timed
                               if c.method == "offload-all" or
                               (c.remat is not None and c.remat.plan.count("offload"))]
    # Graphs compiled again after the first steps (each under its contender's budget).
    info["recompiles"] = counter[0] - compiled
    torch._dynamo.reset()
    _zero(model)
    return _rows(case.name, contenders), info


def _rows(model: str, contenders: list[Contender]) -> list[Row]:
    by_method = {c.method: c for c in contenders}
    none = by_method["none"]
    rows = []
    for c in contenders:
        if not c.times:
            rows.append(Row(model, c.method, 0, 0.0, c.note, remat=c.remat))
            continue
        ratio, spread = _median_ratio(c.times, none.times)
        row = Row(model, c.method, c.peak, statistics.median(c.times), c.note, ratio=ratio,
                  ratio_spread=spread, pair=c.pair, remat=c.remat)
        if c.pair is not None:
            row.pair_ratio, row.pair_spread = _median_ratio(c.times, by_method[c.pair].times)
        rows.append(row)
    return rows


# ---- reporting ----------------------------------------------------------------------------


def format_table(rows: list[Row]) -> str:
    """The main table: per model and contender, the measured activation peak in MiB and over
    ``none``'s, the median step time in ms and the median per-round ratio to ``none``'s.

    >>> rows = [Row("m", "none", 4 * MiB, 0.010, ratio=1.0), Row("m", "ckpt-block", MiB, 0.013, ratio=1.3)]
    >>> print(format_table(rows).splitlines()[2])
    m                  ckpt-block                     1.00    0.25      13.0    1.30
    """
    base = {r.model: r for r in rows if r.method == "none"}
    lines = [
        f"{'model':<18} {'method':<22} {'act peak MiB':>12} {'x none':>7} "
        f"{'step ms':>9} {'x none':>7}  note",
    ]
    for r in rows:
        b = base.get(r.model)
        if r.peak == 0:
            lines.append(f"{r.model:<18} {r.method:<22} {'-':>12} {'-':>7} {'-':>9} {'-':>7}  {r.note}")
            continue
        mem_ratio = r.peak / b.peak if b and b.peak else float("nan")
        lines.append(
            f"{r.model:<18} {r.method:<22} {r.peak / MiB:>12.2f} {mem_ratio:>7.2f} "
            f"{r.step_s * 1e3:>9.1f} {r.ratio:>7.2f}  {r.note}"
        )
    return "\n".join(lines)


def format_remat_table(rows: list[Row]) -> str:
    """Per remat contender: its budget, the strategy, the predicted activation peak against
    the measured one, the predicted overhead (recomputation and stalls; ``run +%``: what
    the planner charged for running the plan, the dispatch mode's per-op cost or each
    checkpointed call's set-up), planning time and the profiled first step's time. Bytes
    are above the step's static bytes, as the main table's are. Rows without remat's
    details are left out:

    >>> print(format_remat_table([Row("m", "none", MiB, 0.01)]))  # doctest: +NORMALIZE_WHITESPACE
    remat budget MiB predicted measured recomp offl pred +% run +% plan ms profile ms x none  strategy
    """
    base = {r.model: r for r in rows if r.method == "none"}
    lines = [
        f"{'remat':<22} {'budget MiB':>10} {'predicted':>9} {'measured':>9} "
        f"{'recomp':>6} {'offl':>4} {'pred +%':>7} {'run +%':>6} {'plan ms':>8} "
        f"{'profile ms':>10} "
        f"{'x none':>6}  strategy",
    ]
    for r in rows:
        info = r.remat
        if info is None:
            if r.method.startswith("remat"):
                lines.append(f"{r.method:<22} {r.note}")
            continue
        plan = info.plan
        static = plan.static_bytes
        b = base.get(r.model)
        first = info.profile_s / b.step_s if b and b.step_s else float("nan")
        measured = f"{r.peak / MiB:9.2f}" if r.peak else f"{'-':>9}"
        lines.append(
            f"{r.method:<22} {(plan.budget_bytes - static) / MiB:>10.2f} "
            f"{(plan.predicted_peak - static) / MiB:>9.2f} {measured} "
            f"{plan.count('recompute'):>6} {plan.count('offload'):>4} "
            f"{plan.overhead * 100:>7.1f} {plan.hook_overhead * 100:>6.1f} "
            f"{info.plan_s * 1e3:>8.0f} {info.profile_s * 1e3:>10.0f} "
            f"{first:>6.1f}  {plan.strategy}")
    return "\n".join(lines)


def pairing_verdicts(rows: list[Row]) -> tuple[list[str], dict[str, bool]]:
    """The equal-memory pairings, one line each, and per model whether remat met the goal:
    at every pairing, remat's measured peak <= the contender's and its step time no slower
    (the median per-round ratio at most 1 + its median absolute deviation, the noise).

    >>> rows = [Row("m", "ckpt-block", 2 * MiB, 0.013),
    ...         Row("m", "remat=ckpt-block", 2 * MiB, 0.012, pair="ckpt-block", pair_ratio=0.95,
    ...             pair_spread=0.02)]
    >>> lines, met = pairing_verdicts(rows)
    >>> met
    {'m': True}
    """
    by_key = {(r.model, r.method): r for r in rows}
    lines, met = [], {}
    for r in rows:
        if not r.method.startswith("remat="):
            continue
        target = r.method.split("=", 1)[1]
        t = by_key.get((r.model, target))
        if r.peak == 0 or t is None:
            lines.append(f"{r.model:<18} {target:<14} remat: {r.note}")
            met[r.model] = False
            continue
        mem_ok = r.peak <= t.peak
        time_ok = r.pair_ratio <= 1 + r.pair_spread
        lines.append(
            f"{r.model:<18} {target:<14} peak {t.peak / MiB:8.2f} vs remat {r.peak / MiB:8.2f} MiB "
            f"({'<=' if mem_ok else '>'}), step {t.step_s * 1e3:8.1f} vs remat "
            f"{r.step_s * 1e3:8.1f} ms, remat/contender {r.pair_ratio:.2f} +- {r.pair_spread:.2f}"
            f"{'' if time_ok else '  SLOWER'}")
        met[r.model] = met.get(r.model, True) and mem_ok and time_ok
    return lines, met


def full_budget_verdict(rows: list[Row]) -> list[str]:
    """Per model, ``remat@1.0`` against ``none``: the median per-round ratio with its median
    absolute deviation, within the goal when it is at most 1.02 + that noise.

    >>> full_budget_verdict([Row("m", "remat@1.0", MiB, 0.01, ratio=1.01, ratio_spread=0.01)])
    ['m: full budget, remat@1.0 / none = 1.010 +- 0.010 (hooked): within 2% of none']
    """
    lines = []
    for r in rows:
        if r.method != "remat@1.0":
            continue
        if r.peak == 0:
            lines.append(f"{r.model}: remat@1.0 did not run: {r.note}")
            continue
        goal = f"{FULL_BUDGET_GOAL - 1:.0%} of none"
        if r.ratio <= FULL_BUDGET_GOAL:
            verdict = f"within {goal}"
        elif r.ratio <= FULL_BUDGET_GOAL + r.ratio_spread:
            verdict = f"within {goal} only within the noise"
        else:
            verdict = f"NOT within {goal}"
        how = ("unhooked, the plan keeps everything" if r.remat and r.remat.plan.keeps_everything
               else "hooked")
        lines.append(
            f"{r.model}: full budget, remat@1.0 / none = {r.ratio:.3f} +- {r.ratio_spread:.3f} "
            f"({how}): {verdict}")
    return lines


def _print_info(model: str, info: dict, total_s: float) -> None:
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in info.get("phases", {}).items())
    parts = [f"{model}: bench {total_s:.0f} s ({phases})" if phases else
             f"{model}: bench {total_s:.0f} s"]
    if info.get("static_bytes") is not None:
        parts.append(f"static bytes {info['static_bytes'] / MiB:.2f} MiB (parameters, buffers "
                     "and inputs the step reads; remat=X budgets are these + X's measured peak)")
    for method, overlap in info.get("overlap", []):
        text = overlap if isinstance(overlap, str) else overlap.describe()
        parts.append(f"{method} copy/compute overlap: {text}")
    if info.get("recompiles"):
        parts.append(f"{info['recompiles']} graphs recompiled after the first step (guards "
                     "failed; each under its own budget, in an untimed step)")
    print("; ".join(parts))


def _to_device(case: Case, device: torch.device) -> Case:
    if device.type == "cpu":
        return case
    case.model.to(device)  # in place: the checkpointing toggles keep their modules
    case.inputs = pytree.tree_map(
        lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, case.inputs)
    return case


def _parse_args(argv: list[str] | None):
    import remat

    parser = argparse.ArgumentParser(prog="python -m remat.bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny configs, for a quick run")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help="comma-separated: " + ", ".join(MODELS) + " (default: all but "
                             "llama-large, which is sized for a GPU)")
    parser.add_argument("--autocast", default="none", choices=("none", "bf16", "fp16"),
                        help="run every contender's forward under torch.autocast to this "
                             "dtype (default none: float32)")
    parser.add_argument("--budgets", default=None,
                        help="fractions of the no-checkpoint activation bytes, for compile@f "
                             "and remat@f (default 0.7,0.5,0.3; 0.5 with --small); remat@1.0 "
                             "always runs")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated contenders besides `none`: " + ", ".join(METHODS))
    parser.add_argument("--bandwidth", default=None,
                        help="host link for remat's offload plans on CUDA, e.g. 25GB/s "
                             "(default: measured); CPU plans recompute only")
    parser.add_argument("--runs", type=int, default=None,
                        help="timed rounds (one step of every contender each, after a "
                             "warm-up round); default 5, 2 with --small")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds remat's planner may search per plan (default: the "
                             "planner's own; 0.25 with --small)")
    parser.add_argument("--device", default="cpu",
                        help="where the models train: cpu (default) or cuda[:N]")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.names = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.names if m not in MODELS]
    if unknown or not args.names:
        parser.error(f"--models: unknown {unknown}; known: {', '.join(MODELS)}")
    if args.budgets is None:
        args.budgets = "0.5" if args.small else "0.7,0.5,0.3"
    try:
        args.fractions = [float(b) for b in args.budgets.split(",") if b]
    except ValueError:
        parser.error(f"--budgets: `{args.budgets}` is not a list of fractions")
    if any(not 0 < b <= 1 for b in args.fractions):
        parser.error("--budgets: each fraction must be in (0, 1]")
    args.method_set = {m for m in args.methods.split(",") if m}
    if args.method_set - set(METHODS):
        parser.error(f"--methods: unknown {sorted(args.method_set - set(METHODS))}; known: "
                     f"{', '.join(METHODS)}")
    if args.bandwidth is not None:
        try:
            args.bandwidth = remat._native.parse_bandwidth(args.bandwidth, "--bandwidth")
        except remat.RematError as error:
            parser.error(str(error))
    try:
        args.device = torch.device(args.device)
    except RuntimeError as error:
        parser.error(f"--device: {error}")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device here")
    if args.device.type not in ("cpu", "cuda"):
        parser.error(f"--device {args.device}: cpu or cuda")
    if args.runs is None:
        args.runs = 2 if args.small else 5
    if args.runs < 1:
        parser.error("--runs: at least 1 round")
    if args.time_limit is None and args.small:
        args.time_limit = 0.25
    if args.time_limit is not None and not args.time_limit > 0:
        parser.error("--time-limit: seconds must be positive")
    if args.threads < 0:
        parser.error("--threads: 0 (torch's default) or more")
    return args


def main(argv: list[str] | None = None) -> int:
    """``python -m remat.bench``: benches each model of ``--models`` and prints its tables and
    verdicts; ``argv`` as on the command line (``--help`` lists the flags). Returns the exit
    status.

    >>> main(["--small", "--models", "gpt2", "--methods", "ckpt,remat", "--budgets", "0.5",
    ...       "--runs", "2", "--threads", "1"])  # doctest: +SKIP
    0
    """
    args = _parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    for name in args.names:
        torch.manual_seed(args.seed)
        case = _to_device(MODELS[name](args.small), args.device)
        case.autocast = AUTOCAST[args.autocast]
        print(f"# {case.name}: running ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        rows, info = bench_case(case, args.fractions, args.runs, args.method_set,
                                args.bandwidth, args.time_limit)
        print(format_table(rows))
        if any(r.method.startswith("remat") for r in rows):
            print(f"remat's plans (MiB above the static bytes; pred +%: the planner's "
                  f"step-time overhead, run +%: what it charged for running the plan; "
                  f"profile: the first step, plain eager while profiled, x none's step):")
            print(format_remat_table(rows))
        _print_info(case.name, info, time.perf_counter() - t0)
        for line in full_budget_verdict(rows):
            print(line)
        lines, met = pairing_verdicts(rows)
        if lines:
            print(f"at equal measured memory (step times: medians of {args.runs} interleaved "
                  "rounds; remat/contender: median per-round ratio +- its median absolute "
                  "deviation):")
            print("\n".join(lines))
            for model, ok in met.items():
                verdict = ("meets the goal: at every pairing no more memory and no slower "
                           "within the noise" if ok else
                           "does NOT meet the goal at every pairing (see above)")
                print(f"{model}: remat {verdict}")
        print(flush=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{time.perf_counter() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
