"""``python -m remat.bench``: remat's plans against PyTorch's own options, side by side.

Models come from their libraries, randomly initialised from configs built here (nothing is
downloaded): transformers' ``LlamaForCausalLM`` (8 layers, d=512) and ``GPT2LMHeadModel``,
torchvision's ``resnet50``. At each budget (a fraction of the no-checkpoint activation
peak) it runs:

- ``none``: eager ``loss.backward()``, nothing recomputed;
- ``ckpt-block``: ``torch.utils.checkpoint`` (non-reentrant) around every block;
- ``compile@f``: ``torch.compile`` with ``torch._functorch.config.activation_memory_budget =
  f`` (the min-cut partitioner's knapsack). The backend is AOTAutograd with that
  partitioner and graphs run op by op (as ``aot_eager``): on CPU, Inductor's code
  generation would take most of the run, and op-by-op execution times the same aten
  kernels as the other contenders;
- ``remat=X``, for each contender X that checkpoints (``ckpt-block``, ``compile@f``):
  ``remat.torch.capture`` once, ``remat.plan`` at a budget equal to X's *measured*
  activation peak (static bytes + that peak, which counts activations, gradients and the
  loss, as remat's simulated peak does above the static bytes), ``remat.torch.apply``. If
  remat's measured peak comes out above X's, it re-plans once lower by the excess. These
  are the rows the goal is read from: at equal measured memory, is remat's step slower?
- ``remat@f``: remat at static bytes + gradient bytes + f x the rest of the captured
  store-all peak (the activations: gradients live to the end of the step in remat's graph
  and no method can drop them, so at small batches a fraction of activations plus
  gradients would be below every method's floor).

Activation peak, measured the same way for every contender: on CPU, every storage created
during the step (outputs of every aten op: a dispatch mode for eager code and remat's
interpreter, the compiled graphs' interpreters for ``torch.compile``) is tracked with a weak
reference, and after each op the bytes of those still alive are summed; the peak of that
sum is reported (activations, gradients and the loss; not parameters or inputs). On CUDA,
``torch.cuda.max_memory_allocated`` above the step's starting level.

Step time, measured without the memory tracking, in ``--runs`` interleaved rounds: each
round runs one step of every contender (the order rotating), so that the drift of a shared
machine falls on all alike; a contender's step time is its median, its ratio to ``none``
the median of the per-round ratios, and each equal-memory pairing's ratio the median of
the per-round remat / contender ratios, with their median absolute deviation as the noise.
"""

from __future__ import annotations

import argparse
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


# ---- models -------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    name: str
    model: torch.nn.Module
    inputs: Any  # dict of keyword inputs or tuple of positional ones
    loss_fn: Callable | None  # remat's loss_fn(model, *inputs); None: output .loss
    enable_block_checkpoint: Callable[[], None]
    disable_block_checkpoint: Callable[[], None]

    def loss(self):
        if isinstance(self.inputs, dict):
            return self.model(**self.inputs).loss
        return self.loss_fn(self.model, *self.inputs)


def _hf_checkpointing(model):
    def enable():
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def disable():
        model.gradient_checkpointing_disable()
        # enable() also hooks the embeddings to make their output require grad.
        if getattr(model, "_require_grads_hook", None) is not None:
            model.disable_input_require_grads()

    return enable, disable


def llama(small: bool) -> Case:
    import transformers

    layers, d, ffn, vocab, seq = (2, 128, 344, 512, 128) if small else (8, 512, 1376, 4096, 256)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=d, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2 * seq)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, vocab, (2, seq))
    return Case(f"llama-{layers}x{d}", model, {"input_ids": ids, "labels": ids}, None,
                *_hf_checkpointing(model))


def gpt2(small: bool) -> Case:
    import transformers

    layers, d, vocab, seq = (2, 128, 512, 128) if small else (4, 512, 4096, 256)
    config = transformers.GPT2Config(vocab_size=vocab, n_embd=d, n_layer=layers, n_head=8,
                                     n_positions=2 * seq, bos_token_id=vocab - 1,
                                     eos_token_id=vocab - 1)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, vocab, (2, seq))
    return Case(f"gpt2-{layers}x{d}", model, {"input_ids": ids, "labels": ids}, None,
                *_hf_checkpointing(model))


class _Checkpointed(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def resnet50(small: bool) -> Case:
    import torchvision

    batch, side = (8, 64) if small else (4, 112)
    model = torchvision.models.resnet50(num_classes=100).train()
    x = torch.randn(batch, 3, side, side)
    y = torch.randint(0, 100, (batch,))
    stages = [model.layer1, model.layer2, model.layer3, model.layer4]
    originals = [list(s) for s in stages]

    def enable():
        for stage, blocks in zip(stages, originals):
            for i, block in enumerate(blocks):
                stage[i] = _Checkpointed(block)

    def disable():
        for stage, blocks in zip(stages, originals):
            for i, block in enumerate(blocks):
                stage[i] = block

    def loss_fn(m, x, y):
        return F.cross_entropy(m(x), y)

    return Case(f"resnet50-{side}px", model, (x, y), loss_fn, enable, disable)


MODELS = {"llama": llama, "gpt2": gpt2, "resnet50": resnet50}


# ---- measuring ----------------------------------------------------------------------------


class LiveBytes:
    """Bytes of the storages made during a step that are still alive, sampled after every
    op that records its outputs here; ``peak`` is the largest sample. ``existing``: storages
    that were there before the step (parameters, buffers, inputs), which op outputs may
    alias (``t(weight)``, ``detach``) but which the step did not make."""

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


_MODE_LIVE: list[LiveBytes | None] = [None]


def _LIVE_OBSERVER(value) -> None:
    live = _MODE_LIVE[0]
    if live is not None:
        live.record(value)


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

    def run(*args):
        return Counting(gm).run(*args)

    run._boxed_call = False
    return run


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
class Contender:
    """One way to run the training step. ``step`` runs it; ``enter`` / ``leave`` (untimed)
    put the model into and out of the state it needs (checkpointing wrappers)."""

    method: str
    step: Callable[[], Any]
    enter: Callable[[], None] = lambda: None
    leave: Callable[[], None] = lambda: None
    uses_mode: bool = True  # its ops run in eager code, visible to a dispatch mode
    peak: int = 0
    times: list[float] = dataclasses.field(default_factory=list)
    note: str = ""
    pair: str | None = None  # remat's equal-memory rows: the contender they are paired with
    close: Callable[[], None] = lambda: None


@dataclasses.dataclass
class Row:
    model: str
    method: str
    peak: int
    step_s: float
    note: str = ""
    ratio: float = float("nan")  # median over rounds of (this step / none's step)
    pair: str | None = None
    pair_ratio: float = float("nan")  # median over rounds of (this step / pair's step)
    pair_spread: float = float("nan")  # median absolute deviation of those ratios


def _zero(model):
    for p in model.parameters():
        p.grad = None


def _existing_storages(case: Case) -> set[int]:
    tensors = [*case.model.parameters(), *case.model.buffers()]
    tensors += [t for t in pytree.tree_leaves(case.inputs) if isinstance(t, torch.Tensor)]
    return {t.untyped_storage().data_ptr() for t in tensors}


def _measure_peak(c: Contender, case: Case, device) -> int:
    """Activation peak in bytes of one step of ``c`` (after an untimed warm-up step)."""
    c.enter()
    try:
        c.step()  # warm-up: lazy initialisation is not anyone's memory
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            c.step()
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device) - base
        # Non-reentrant checkpointing leaves reference cycles: collect them first, so that
        # one contender's garbage is not counted against the next.
        gc.collect()
        live = LiveBytes(_existing_storages(case))
        _COMPILED_LIVE[0] = live
        _MODE_LIVE[0] = live
        try:
            if c.uses_mode:
                with _Recording(live):
                    c.step()
            else:
                c.step()
        finally:
            _COMPILED_LIVE[0] = None
            _MODE_LIVE[0] = None
        return live.peak
    finally:
        c.leave()


def time_interleaved(contenders: list[Contender], rounds: int, device) -> None:
    """Times ``rounds`` rounds of one step of each contender (the first untimed, a warm-up),
    rotating the order each round, so that drift of the shared machine (other processes,
    frequency) falls on all of them alike; appends each step's seconds to ``times``."""
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
            if r > 0:
                c.times.append(elapsed)


def _median_ratio(a: list[float], b: list[float]) -> tuple[float, float]:
    """Median of the per-round ratios a[i] / b[i], and their median absolute deviation."""
    ratios = [x / y for x, y in zip(a, b) if y > 0]
    if not ratios:
        return float("nan"), float("nan")
    mid = statistics.median(ratios)
    return mid, statistics.median(abs(x - mid) for x in ratios)


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


class _RematPlanner:
    """Captures the step once and makes remat contenders at byte budgets."""

    def __init__(self, case: Case, bandwidth: float, time_limit: float | None):
        import remat.torch as rt

        self.case = case
        self.bandwidth = bandwidth
        self.time_limit = time_limit
        t0 = time.perf_counter()
        self.captured = rt.capture(case.model, case.inputs, loss_fn=case.loss_fn, runs=3)
        self.capture_s = time.perf_counter() - t0
        self.static = self.captured.static_bytes
        self.grads = sum(p.numel() * p.element_size() for p in case.model.parameters()
                         if p.requires_grad)
        self.plan_s: list[float] = []

    def fraction_budget(self, f: float) -> int:
        """Static bytes + gradient bytes + f x the captured store-all peak's activations:
        gradients live to the end of the step in remat's graph and no method can drop them,
        so at small batches f x (activations + gradients) would be below every floor."""
        store_all = self.captured.store_all_peak()
        return self.static + self.grads + int(f * (store_all - self.static - self.grads))

    def measured_budget(self, peak: int) -> int:
        """The budget at which remat's plan may hold what a contender was measured holding:
        the measured peak counts the step's activations, gradients and loss, which is remat's
        simulated peak less the static bytes (parameters, inputs)."""
        return self.static + peak

    def contender(self, method: str, budget: int) -> Contender:
        import remat
        import remat.torch as rt

        t0 = time.perf_counter()
        try:
            plan = remat.plan(self.captured, budget, bandwidth=self.bandwidth,
                              time_limit=self.time_limit)
        except remat.BudgetError as error:
            return Contender(method, lambda: None, note=f"infeasible: {error}")
        plan_s = time.perf_counter() - t0
        self.plan_s.append(plan_s)
        step = rt.apply(self.captured, plan)
        # Swapped-in values are made on the prefetch thread, out of the dispatch mode's
        # sight: the interpreter reports what it holds too.
        step.observer = _LIVE_OBSERVER
        args = self.case.inputs

        def planned():
            _loss, grads = step(**args) if isinstance(args, dict) else step(*args)
            return grads

        bound = "-" if plan.lower_bound is None else f">= +{plan.lower_bound * 100:.0f}%"
        note = (f"{plan.strategy}, predicted +{plan.overhead * 100:.0f}% (bound {bound})"
                f"{', reordered' if plan.reorders else ''}; plan {plan_s * 1e3:.0f} ms; "
                f"predicted peak {(plan.peak_bytes - self.static) / 2**20:.1f} MiB")
        return Contender(method, planned, note=note, close=step.close)


def _equal_memory(planner: _RematPlanner, target: Contender, case: Case, device) -> Contender:
    """remat planned at ``target``'s measured peak. Memory the graph does not see (an op's
    scratch) can take the measured peak above the plan's; then it re-plans once, lower by
    the excess, so that the pairing is at equal measured memory."""
    method = f"remat={target.method}"
    budget = planner.measured_budget(target.peak)
    c = planner.contender(method, budget)
    if c.note.startswith("infeasible"):
        return c
    c.peak = _measure_peak(c, case, device)
    if c.peak > target.peak:
        c.close()
        excess = c.peak - target.peak
        c = planner.contender(method, budget - excess)
        if c.note.startswith("infeasible"):
            return c
        c.peak = _measure_peak(c, case, device)
        c.note += f"; re-planned {excess / 2**20:.1f} MiB lower"
    c.pair = target.method
    return c


def bench_case(case: Case, budgets: list[float], runs: int, methods: set[str],
               bandwidth: float | None = None,
               time_limit: float | None = None) -> tuple[list[Row], dict]:
    model = case.model
    device = next(model.parameters()).device
    info: dict = {}
    # Host link the swaps are planned with: PCIe on CUDA. On CPU the "host" is the file
    # store, whose copies take CPU time from the computation: on the 2-core host of the
    # first runs, plans made at 2 GB/s (MuTWO swapping) ran 1.2-2.1x the no-checkpoint
    # step, plans made at 0.1 GB/s (recomputing) 1.05-1.25x; hence 0.1 GB/s.
    bandwidth = bandwidth or (32e9 if device.type == "cuda" else 0.1e9)

    def eager():
        _zero(model)
        case.loss().backward()

    eager()  # the first step pays for lazy initialisation: not anyone's time
    contenders = [Contender("none", eager)]
    if "ckpt" in methods:
        contenders.append(Contender("ckpt-block", eager, case.enable_block_checkpoint,
                                    case.disable_block_checkpoint))
    counter = [0]
    if "compile" in methods:
        torch._dynamo.reset()
        contenders += _compile_contenders(case, budgets, counter)
    compiled = counter[0]
    for c in contenders:
        if not c.note.startswith("failed"):
            c.peak = _measure_peak(c, case, device)

    if "remat" in methods:
        planner = _RematPlanner(case, bandwidth, time_limit)
        info.update(capture_s=planner.capture_s, nodes=planner.captured.num_nodes,
                    trace_s=planner.captured.timings["trace_s"], plan_s=planner.plan_s)
        checkpointing = [c for c in contenders if c.method != "none" and c.peak > 0]
        for target in checkpointing:
            contenders.append(_equal_memory(planner, target, case, device))
        for f in budgets:
            c = planner.contender(f"remat@{f}", planner.fraction_budget(f))
            if not c.note.startswith("infeasible"):
                c.peak = _measure_peak(c, case, device)
            contenders.append(c)

    timed = [c for c in contenders if c.peak > 0]
    time_interleaved(timed, runs, device)
    # Graphs compiled again after the first steps (each under its contender's budget).
    info["recompiles"] = counter[0] - compiled
    for c in contenders:
        c.close()
    torch._dynamo.reset()
    _zero(model)
    return _rows(case.name, contenders), info


def _rows(model: str, contenders: list[Contender]) -> list[Row]:
    by_method = {c.method: c for c in contenders}
    none = by_method["none"]
    rows = []
    for c in contenders:
        if not c.times:
            rows.append(Row(model, c.method, 0, 0.0, c.note))
            continue
        row = Row(model, c.method, c.peak, statistics.median(c.times), c.note,
                  ratio=_median_ratio(c.times, none.times)[0], pair=c.pair)
        if c.pair is not None:
            row.pair_ratio, row.pair_spread = _median_ratio(c.times, by_method[c.pair].times)
        rows.append(row)
    return rows


def format_table(rows: list[Row]) -> str:
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
            f"{r.model:<18} {r.method:<22} {r.peak / 2**20:>12.2f} {mem_ratio:>7.2f} "
            f"{r.step_s * 1e3:>9.1f} {r.ratio:>7.2f}  {r.note}"
        )
    return "\n".join(lines)


def pairing_verdicts(rows: list[Row]) -> tuple[list[str], dict[str, bool]]:
    """The equal-memory pairings, one line each, and per model whether remat met the goal:
    at every pairing, remat's measured peak <= the contender's and its step time no slower
    (the median per-round ratio at most 1 + its median absolute deviation, the noise)."""
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
            f"{r.model:<18} {target:<14} peak {t.peak / 2**20:8.2f} vs remat {r.peak / 2**20:8.2f} MiB "
            f"({'<=' if mem_ok else '>'}), step {t.step_s * 1e3:8.1f} vs remat "
            f"{r.step_s * 1e3:8.1f} ms, remat/contender {r.pair_ratio:.2f} +- {r.pair_spread:.2f}"
            f"{'' if time_ok else '  SLOWER'}")
        met[r.model] = met.get(r.model, True) and mem_ok and time_ok
    return lines, met


def _print_info(model: str, info: dict, total_s: float) -> None:
    parts = [f"{model}: bench {total_s:.0f} s"]
    if "capture_s" in info:
        plans = ", ".join(f"{s * 1e3:.0f}" for s in info["plan_s"])
        parts.append(f"capture {info['capture_s']:.1f} s (trace {info['trace_s']:.1f} s, "
                     f"{info['nodes']} nodes), planning {plans} ms")
    if info.get("recompiles"):
        parts.append(f"{info['recompiles']} graphs recompiled after the first step (guards "
                     "failed; each under its own budget, in an untimed step)")
    print("; ".join(parts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m remat.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny configs, for a quick run")
    parser.add_argument("--models", default="llama,gpt2,resnet50",
                        help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--budgets", default="0.7,0.5,0.3",
                        help="fractions of the no-checkpoint activation peak")
    parser.add_argument("--methods", default="ckpt,compile,remat",
                        help="comma-separated contenders besides `none`: ckpt, compile, remat")
    parser.add_argument("--bandwidth", default=None,
                        help="host link for remat's swaps, e.g. 2GB/s (default: 32GB/s on "
                             "CUDA, 0.1GB/s on CPU, where swaps go to files)")
    parser.add_argument("--runs", type=int, default=None,
                        help="timed rounds (one step of every contender each, after a "
                             "warm-up round); default 5, 2 with --small")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds remat's planner may search per plan (default: the "
                             "planner's, 1 s up to 1,000 nodes, 1 ms per node above)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {unknown}; known: {', '.join(MODELS)}")
    try:
        budgets = [float(b) for b in args.budgets.split(",") if b]
    except ValueError:
        parser.error(f"--budgets: `{args.budgets}` is not a list of fractions")
    if any(not 0 < b <= 1 for b in budgets):
        parser.error("--budgets: each fraction must be in (0, 1]")
    methods = {m for m in args.methods.split(",") if m}
    if methods - {"ckpt", "compile", "remat"}:
        parser.error(f"--methods: unknown {sorted(methods - {'ckpt', 'compile', 'remat'})}")
    if args.runs is None:
        args.runs = 2 if args.small else 5
    if args.runs < 1:
        parser.error("--runs: at least 1 round")
    if args.threads:
        torch.set_num_threads(args.threads)
    for name in names:
        torch.manual_seed(args.seed)
        case = MODELS[name](args.small)
        print(f"# {case.name}: running ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        rows, info = bench_case(case, budgets, args.runs, methods, args.bandwidth,
                                args.time_limit)
        print(format_table(rows))
        _print_info(case.name, info, time.perf_counter() - t0)
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
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
