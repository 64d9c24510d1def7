#!/usr/bin/env python3
"""Replays one `remat train` step in Hugging Face `transformers` and compares the gradients.

remat's GPT is the Llama block (RMSNorm, rotate-half RoPE, SwiGLU, no biases, untied head),
`remat train --block qwen3|qwen3-moe` trains Qwen3 / Qwen3-MoE blocks and `--block mamba`
Mamba-1 blocks (transformers' `MambaForCausalLM`, whose CPU path is the slow reference
scan), so with the same weights and batch, `transformers`' model of the dumped config must
give the same loss and the same gradients up to float rounding. This script:

1. runs `remat train --steps 1 --dump-grads` once to learn the model and the batch (a dump
   records its batch as `remat.input_ids` / `remat.labels` and the model as a Hugging Face
   config in its metadata);
2. builds the `transformers` causal LM of that config with random weights (norm weights perturbed
   away from 1, so that a layout mix-up cannot hide behind ones), saves them, and runs
   `remat train --init` on them with `--dump-grads`;
3. computes the same step in PyTorch in float32 and in float64, and reports, per tensor,
   the relative L2 error of remat's gradient and of PyTorch's float32 gradient, both
   against float64.

It exits with status 1 when a remat gradient is further from float64 than
`--factor` times PyTorch's own float32 error (plus a floor of `--floor`), or when the
losses differ by more than that.

Needs `torch`, `transformers` and `safetensors` (not part of remat's CI):
    python3 -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers safetensors
    /tmp/hf/bin/python scripts/check_against_hf.py --remat target/release/remat -- --layers 3
    /tmp/hf/bin/python scripts/check_against_hf.py -- --block qwen3-moe
    /tmp/hf/bin/python scripts/check_against_hf.py -- --block mamba --block-set scan_chunk=5
Arguments after `--` go to `remat train` (model sizes, --block, --data, --seed, ...).
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM


def run_remat(remat, args):
    cmd = [remat, "train", "--steps", "1", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr}")


def read_dump(path):
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    missing = [k for k in ("remat.hf_config", "remat.loss", "remat.dropout") if k not in meta]
    if missing:
        sys.exit(f"{path}: no step record in the metadata ({', '.join(missing)} missing)")
    return meta, tensors


def as_released(tensors):
    """Tensors under the names released checkpoints use (and remat reads and writes):
    transformers 5 keeps a MoE layer's experts fused, `mlp.experts.gate_up_proj`
    `[experts, 2 * moe_intermediate, hidden]` (gate rows first) and `mlp.experts.down_proj`
    `[experts, hidden, moe_intermediate]`; checkpoints hold one tensor per expert."""
    out = {}
    for name, t in tensors.items():
        prefix = name.rsplit("experts.", 1)[0] + "experts."
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = gate[e]
                out[f"{prefix}{e}.up_proj.weight"] = up[e]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def hf_step(model, input_ids, labels):
    """Loss and gradients of one step: mean cross-entropy over the labels not -100."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=input_ids).logits
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return loss.item(), as_released(grads)


def rel_err(x, ref):
    ref = ref.double()
    scale = ref.norm().item()
    diff = (x.double() - ref).norm().item()
    return diff / scale if scale > 0 else diff


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--remat", default="target/release/remat", help="the remat binary")
    parser.add_argument("--workdir", help="keep the files here (default: a temporary dir)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the transformers weights")
    parser.add_argument("--factor", type=float, default=10.0)
    parser.add_argument("--floor", type=float, default=1e-6)
    parser.add_argument("remat_args", nargs="*", help="arguments for `remat train` (after --)")
    opts = parser.parse_args()
    work = Path(opts.workdir or tempfile.mkdtemp(prefix="remat-hf-check-"))
    work.mkdir(parents=True, exist_ok=True)

    probe = work / "probe.safetensors"
    run_remat(opts.remat, [*opts.remat_args, "--dump-grads", str(probe)])
    meta, _ = read_dump(probe)
    if float(meta["remat.dropout"]) != 0.0:
        sys.exit("the step used dropout: Llama has none, so the gradients cannot match")
    fields = json.loads(meta["remat.hf_config"])
    for key, what in (("remat_shared_expert", "a shared expert"), ("remat_attention_bias", "attention biases")):
        if key in fields:
            sys.exit(f"the model has {what}: {fields[key]}")
    # How remat chunks the scan changes no value: not a transformers setting.
    fields.pop("remat_scan_chunk", None)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    print(f"model: {type(config).__name__} {json.dumps(fields, sort_keys=True)}")

    torch.manual_seed(opts.seed)
    # Eager attention and experts: the fused kernels have no float64 path on CPU.
    config._experts_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight", "mixer.D", "mixer.A_log")):
                # Away from ones (norms, Mamba's D) and from log(1..N) (A_log), so that a
                # layout mix-up cannot hide behind repeated values.
                p.add_(0.1 * torch.randn_like(p))
            elif "experts" in name:
                # transformers leaves fused expert weights to checkpoint loading (the
                # module's init fills them with zeros or noise, depending on the version).
                torch.nn.init.normal_(p, std=0.05)
    init = work / "init.safetensors"
    weights = as_released({n: p.detach() for n, p in model.named_parameters()})
    save_file({n: t.contiguous() for n, t in weights.items()}, str(init))

    grads_path = work / "grads.safetensors"
    run_remat(opts.remat, [*opts.remat_args, "--init", str(init), "--dump-grads", str(grads_path)])
    meta, dump = read_dump(grads_path)
    input_ids, labels = dump["remat.input_ids"], dump["remat.labels"]
    remat_loss = float(meta["remat.loss"])

    loss32, grads32 = hf_step(model, input_ids, labels)
    loss64, grads64 = hf_step(model.double(), input_ids, labels)

    failures = []
    bound = lambda torch_err: opts.factor * torch_err + opts.floor  # noqa: E731
    rows = []
    for name in grads64:
        if name not in dump:
            failures.append(f"{name}: not in remat's dump")
            continue
        if tuple(dump[name].shape) != tuple(grads64[name].shape):
            failures.append(f"{name}: shape {tuple(dump[name].shape)} vs {tuple(grads64[name].shape)}")
            continue
        ours, theirs = rel_err(dump[name], grads64[name]), rel_err(grads32[name], grads64[name])
        rows.append((name, ours, theirs))
        if ours > bound(theirs):
            failures.append(f"{name}: remat's error {ours:.2e} > {bound(theirs):.2e}")
    extra = sorted(n for n in dump if not n.startswith("remat.") and n not in grads64)
    failures += [f"{n}: in remat's dump, not a parameter of the transformers model" for n in extra]

    width = max(len(r[0]) for r in rows) if rows else 10
    print(f"{'tensor':<{width}}  remat f32 vs f64  torch f32 vs f64  (relative L2 error)")
    print(f"{'-' * width}  ----------------  ----------------")
    for name, ours, theirs in rows:
        print(f"{name:<{width}}  {ours:16.2e}  {theirs:16.2e}")
    loss_ours, loss_theirs = abs(remat_loss - loss64), abs(loss32 - loss64)
    print(f"loss: remat {remat_loss:.9f}, torch f32 {loss32:.9f}, torch f64 {loss64:.9f}")
    if loss_ours > bound(loss_theirs) + 1e-6 * abs(loss64):
        failures.append(f"loss: remat is {loss_ours:.2e} from float64, torch f32 {loss_theirs:.2e}")
    worst = max((r[1] for r in rows), default=0.0)
    print(f"{len(rows)} gradients compared; worst remat relative error {worst:.2e}; files in {work}")
    if failures:
        print("MISMATCH:\n  " + "\n  ".join(failures))
        return 1
    print(f"remat's step matches transformers' {type(model).__name__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
