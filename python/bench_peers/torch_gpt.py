# The PyTorch side of `remat bench engine --torch PYTHON`: the benchmark GPT (token
# embedding, L blocks of RMSNorm, causal attention with rotate-half RoPE, residual, RMSNorm,
# SwiGLU MLP, residual; final norm; untied LM head; cross-entropy), one training step
# (forward + backward, no optimizer update) per request, so that remat can time both
# programs in the same rounds. Protocol: after warming up it prints "ready"; then each line
# on stdin names a policy ("store-all" or "per-block") and is answered with the step's
# wall time in seconds; an empty line or end of input ends it.
# It lives with the Python code but is not part of the `remat` package: the benchmark
# (`crates/remat-bench/src/torch.rs`) embeds it with include_str! and runs it as
# `python -c SCRIPT ARGS`, so it is not installed by `pip install ./python`.
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def parse(argv):
    keys = ["layers", "d_model", "heads", "ffn", "vocab", "batch", "seq", "threads"]
    if len(argv) != len(keys):
        sys.exit(f"expected {len(keys)} arguments ({' '.join(keys)}), got {len(argv)}")
    return dict(zip(keys, map(int, argv)))


def rope_tables(seq, head_dim, theta=10000.0):
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), freqs)
    angles = torch.cat([angles, angles], dim=-1)  # rotate-half pairs i with i + dim/2
    return angles.cos(), angles.sin()


def rotate_half(x, cos, sin):
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class Block(nn.Module):
    def __init__(self, d, heads, ffn):
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.RMSNorm(d, eps=1e-5)
        self.mlp_norm = nn.RMSNorm(d, eps=1e-5)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate = nn.Linear(d, ffn, bias=False)
        self.up = nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        split = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        h = self.attn_norm(x)
        q = rotate_half(split(self.q(h)), cos, sin)
        k = rotate_half(split(self.k(h)), cos, sin)
        a = F.scaled_dot_product_attention(q, k, split(self.v(h)), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Gpt(nn.Module):
    def __init__(self, c):
        super().__init__()
        d = c["d_model"]
        self.embed = nn.Embedding(c["vocab"], d)
        self.blocks = nn.ModuleList(Block(d, c["heads"], c["ffn"]) for _ in range(c["layers"]))
        self.norm = nn.RMSNorm(d, eps=1e-5)
        self.head = nn.Linear(d, c["vocab"], bias=False)
        self.cos, self.sin = rope_tables(c["seq"], d // c["heads"])

    def forward(self, tokens, targets, per_block):
        x = self.embed(tokens)
        for block in self.blocks:
            if per_block:
                x = checkpoint(block, x, self.cos, self.sin, use_reentrant=False)
            else:
                x = block(x, self.cos, self.sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def main():
    c = parse(sys.argv[1:])
    torch.set_num_threads(c["threads"])
    torch.manual_seed(0)
    model = Gpt(c)
    tokens = torch.randint(0, c["vocab"], (c["batch"], c["seq"]))
    targets = torch.randint(0, c["vocab"], (c["batch"], c["seq"]))

    def step(policy):
        if policy not in ("store-all", "per-block"):
            raise SystemExit(f"unknown policy {policy!r}")
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model(tokens, targets, policy == "per-block").backward()
        return time.perf_counter() - start

    for policy in ("store-all", "per-block"):
        step(policy)
    print(f"ready {torch.__version__}", flush=True)
    for line in sys.stdin:
        policy = line.strip()
        if not policy:
            break
        print(f"{step(policy):.6f}", flush=True)


main()
