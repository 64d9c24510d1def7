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
- ``remat@f``: ``remat.torch.capture`` once, ``remat.plan`` at static bytes + gradient
  bytes + f x the rest of the captured store-all peak (the activations: gradients live to
  the end of the step in remat's graph and no method can drop them, so at small batches
  a fraction of activations plus gradients would be below every method's floor),
  ``remat.torch.apply``.

Activation peak, measured the same way for every contender: on CPU, every storage created
during the step (outputs of every aten op: a dispatch mode for eager code and remat's
interpreter, the compiled graphs' interpreters for ``torch.compile``) is tracked with a weak
reference, and after each op the bytes of those still alive are summed; the peak of that
sum is reported (activations, gradients and the loss; not parameters or inputs). On CUDA,
``torch.cuda.max_memory_allocated`` above the step's starting level. Step time: median of
``--runs`` steps, measured without the memory tracking.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
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


def _compile_backend():
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(fw_compiler=_counting_compiler, bw_compiler=_counting_compiler,
                        partition_fn=min_cut_rematerialization_partition,
                        keep_inference_input_mutations=True)


@dataclasses.dataclass
class Row:
    model: str
    method: str
    peak: int
    step_s: float
    note: str = ""


def _zero(model):
    for p in model.parameters():
        p.grad = None


def _existing_storages(case: Case) -> set[int]:
    tensors = [*case.model.parameters(), *case.model.buffers()]
    tensors += [t for t in pytree.tree_leaves(case.inputs) if isinstance(t, torch.Tensor)]
    return {t.untyped_storage().data_ptr() for t in tensors}


def _measure(run_step: Callable[[], Any], *, runs: int, device, uses_mode: bool,
             existing: set[int]):
    """(activation peak in bytes, median step seconds) of ``run_step``."""
    run_step()  # warm-up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        run_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        run_step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        # Non-reentrant checkpointing leaves reference cycles: collect them first, so that
        # one contender's garbage is not counted against the next.
        gc.collect()
        live = LiveBytes(existing)
        _COMPILED_LIVE[0] = live
        try:
            _MODE_LIVE[0] = live
            if uses_mode:
                with _Recording(live):
                    run_step()
            else:
                run_step()
        finally:
            _COMPILED_LIVE[0] = None
            _MODE_LIVE[0] = None
        peak = live.peak
    return peak, statistics.median(times)


def bench_case(case: Case, budgets: list[float], runs: int, methods: set[str],
               bandwidth: float | None = None) -> tuple[list[Row], dict]:
    import remat
    import remat.torch as rt

    model = case.model
    device = next(model.parameters()).device
    rows: list[Row] = []
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
    peak, step_s = _measure(eager, runs=runs, device=device, uses_mode=True,
                                existing=_existing_storages(case))
    rows.append(Row(case.name, "none", peak, step_s))

    if "ckpt" in methods:
        case.enable_block_checkpoint()
        try:
            peak, step_s = _measure(eager, runs=runs, device=device, uses_mode=True,
                                existing=_existing_storages(case))
        finally:
            case.disable_block_checkpoint()
        rows.append(Row(case.name, "ckpt-block", peak, step_s))

    if "remat" in methods:
        t0 = time.perf_counter()
        captured = rt.capture(model, case.inputs, loss_fn=case.loss_fn, runs=3)
        info["capture_s"] = time.perf_counter() - t0
        info["nodes"] = captured.num_nodes
        info["trace_s"] = captured.timings["trace_s"]
        static = captured.static_bytes
        grads = sum(p.numel() * p.element_size() for p in model.parameters()
                    if p.requires_grad)
        info["plan_s"] = []
        for f in budgets:
            budget = static + grads + int(f * (captured.store_all_peak() - static - grads))
            t0 = time.perf_counter()
            try:
                plan = remat.plan(captured, budget, bandwidth=bandwidth)
            except remat.BudgetError as error:
                rows.append(Row(case.name, f"remat@{f}", 0, 0.0, f"infeasible: {error}"))
                continue
            info["plan_s"].append(time.perf_counter() - t0)
            step = rt.apply(captured, plan)
            # Swapped-in values are made on the prefetch thread, out of the dispatch mode's
            # sight: the interpreter reports what it holds too.
            step.observer = _LIVE_OBSERVER

            def planned():
                args = case.inputs
                loss, grads = step(**args) if isinstance(args, dict) else step(*args)
                return grads

            peak, step_s = _measure(planned, runs=runs, device=device, uses_mode=True,
                                existing=_existing_storages(case))
            note = (f"{plan.strategy}, predicted +{plan.overhead * 100:.0f}%; interpreter {step.stats.peak_bytes / 2**20:.1f} MiB "
                    f"<= plan {(plan.peak_bytes - static) / 2**20:.1f} MiB")
            rows.append(Row(case.name, f"remat@{f}", peak, step_s, note))
            step.close()

    if "compile" in methods:
        backend = _compile_backend()
        for f in budgets:
            torch._dynamo.reset()
            old = torch._functorch.config.activation_memory_budget
            torch._functorch.config.activation_memory_budget = f
            try:
                compiled = torch.compile(lambda: case.loss(), backend=backend)

                def compiled_step():
                    _zero(model)
                    compiled().backward()

                t0 = time.perf_counter()
                compiled_step()
                compile_s = time.perf_counter() - t0
                peak, step_s = _measure(compiled_step, runs=runs, device=device,
                                        uses_mode=False, existing=_existing_storages(case))
                rows.append(Row(case.name, f"compile@{f}", peak, step_s,
                                f"compile {compile_s:.1f} s"))
            except Exception as error:  # noqa: BLE001 - reported in the table
                rows.append(Row(case.name, f"compile@{f}", 0, 0.0,
                                f"failed: {type(error).__name__}: {str(error)[:80]}"))
            finally:
                torch._functorch.config.activation_memory_budget = old
        torch._dynamo.reset()
    _zero(model)
    return rows, info


def format_table(rows: list[Row]) -> str:
    base = {r.model: r for r in rows if r.method == "none"}
    lines = [
        f"{'model':<18} {'method':<14} {'act peak MiB':>12} {'x none':>7} "
        f"{'step ms':>9} {'x none':>7}  note",
    ]
    for r in rows:
        b = base.get(r.model)
        if r.peak == 0:
            lines.append(f"{r.model:<18} {r.method:<14} {'-':>12} {'-':>7} {'-':>9} {'-':>7}  {r.note}")
            continue
        mem_ratio = r.peak / b.peak if b and b.peak else float("nan")
        time_ratio = r.step_s / b.step_s if b and b.step_s else float("nan")
        lines.append(
            f"{r.model:<18} {r.method:<14} {r.peak / 2**20:>12.2f} {mem_ratio:>7.2f} "
            f"{r.step_s * 1e3:>9.1f} {time_ratio:>7.2f}  {r.note}"
        )
    return "\n".join(lines)


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
    parser.add_argument("--runs", type=int, default=2, help="timed steps per contender")
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
    if args.threads:
        torch.set_num_threads(args.threads)
    rows: list[Row] = []
    infos = {}
    for name in names:
        torch.manual_seed(args.seed)
        case = MODELS[name](args.small)
        print(f"# {case.name}: running ...", file=sys.stderr, flush=True)
        case_rows, info = bench_case(case, budgets, args.runs, methods, args.bandwidth)
        rows.extend(case_rows)
        infos[case.name] = info
    print(format_table(rows))
    for model, info in infos.items():
        if "capture_s" in info:
            plans = ", ".join(f"{s * 1e3:.0f} ms" for s in info["plan_s"])
            print(f"{model}: capture {info['capture_s']:.1f} s (trace {info['trace_s']:.1f} s, "
                  f"{info['nodes']} nodes), "
                  f"planning {plans}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
