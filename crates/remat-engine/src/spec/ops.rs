//! The registry of recompute ops a spec may name in `recompute_op`: their arity, outputs and
//! required attributes. The runtime implements exactly these names; the forward pass calls
//! the same implementations, which is what makes a recomputed slot equal the forward's bit
//! for bit.

/// The schema of one registered op.
#[derive(Debug, Clone, Copy)]
pub struct OpSchema {
    pub name: &'static str,
    /// Operand names in order; a trailing `?` marks an optional operand.
    pub inputs: &'static [&'static str],
    pub outputs: &'static [&'static str],
    pub required_attrs: &'static [&'static str],
    pub description: &'static str,
}

impl OpSchema {
    pub fn min_inputs(&self) -> usize {
        self.inputs.iter().filter(|i| !i.ends_with('?')).count()
    }
}

/// `recompute_op` left out: rebuild the slot by replaying the forward op that produced it.
pub const REPLAY: &str = "replay";

pub const OPS: &[OpSchema] = &[
    OpSchema {
        name: "rmsnorm",
        inputs: &["x", "weight"],
        outputs: &["y", "rstd"],
        required_attrs: &["eps"],
        description: "RMSNorm over the last dim; also yields the reciprocal std",
    },
    OpSchema {
        name: "rmsnorm_apply",
        inputs: &["x", "weight", "rstd"],
        outputs: &["y"],
        required_attrs: &[],
        description: "RMSNorm from a saved reciprocal std (no reduction)",
    },
    OpSchema {
        name: "head_rmsnorm",
        inputs: &["x", "weight"],
        outputs: &["y", "rstd"],
        required_attrs: &["eps"],
        description: "RMSNorm per attention head (QK-norm); weight has head_dim entries",
    },
    OpSchema {
        name: "head_rmsnorm_apply",
        inputs: &["x", "weight", "rstd"],
        outputs: &["y"],
        required_attrs: &[],
        description: "QK-norm from a saved reciprocal std",
    },
    OpSchema {
        name: "linear",
        inputs: &["x", "weight", "bias?"],
        outputs: &["y"],
        required_attrs: &[],
        description: "y = x W^T (+ b)",
    },
    OpSchema {
        name: "qkv_proj",
        inputs: &["x", "wq", "wk", "wv", "bq?", "bk?", "bv?"],
        outputs: &["q", "k", "v"],
        required_attrs: &[],
        description: "the three attention projections of one input, optional biases",
    },
    OpSchema {
        name: "rope",
        inputs: &["x", "cos", "sin"],
        outputs: &["y"],
        required_attrs: &["head_dim"],
        description: "rotary position embedding (rotate-half layout)",
    },
    OpSchema {
        name: "attention",
        inputs: &["q", "k", "v"],
        outputs: &["o", "lse"],
        required_attrs: &["heads", "kv_heads"],
        description: "causal grouped-query attention; lse = per-row log-sum-exp",
    },
    OpSchema {
        name: "add",
        inputs: &["a", "b"],
        outputs: &["y"],
        required_attrs: &[],
        description: "elementwise sum (residual)",
    },
    OpSchema {
        name: "swiglu",
        inputs: &["gate", "up"],
        outputs: &["y"],
        required_attrs: &[],
        description: "silu(gate) * up",
    },
    OpSchema {
        name: "topk_softmax",
        inputs: &["logits"],
        outputs: &["weights", "indices"],
        required_attrs: &["k"],
        description: "softmax router, top-k (lower expert index wins ties), optional renorm",
    },
    OpSchema {
        name: "moe_gate_up",
        inputs: &["x", "indices", "w_gate", "w_up"],
        outputs: &["gate", "up"],
        required_attrs: &[],
        description: "per (token, choice) row: the chosen expert's gate and up projections",
    },
    OpSchema {
        name: "moe_down",
        inputs: &["act", "indices", "w_down"],
        outputs: &["y"],
        required_attrs: &[],
        description: "per (token, choice) row: the chosen expert's down projection",
    },
    OpSchema {
        name: "moe_combine",
        inputs: &["expert_out", "weights", "shared?"],
        outputs: &["y"],
        required_attrs: &[],
        description: "weighted sum of a token's k expert rows (plus the shared expert)",
    },
    OpSchema {
        name: "causal_conv1d",
        inputs: &["x", "weight", "bias?"],
        outputs: &["y"],
        required_attrs: &[],
        description: "depthwise causal conv over the first channels of x (Mamba); weight [C, 1, K]",
    },
    OpSchema {
        name: "silu",
        inputs: &["x"],
        outputs: &["y"],
        required_attrs: &[],
        description: "x * sigmoid(x)",
    },
    OpSchema {
        name: "softplus",
        inputs: &["x"],
        outputs: &["y"],
        required_attrs: &[],
        description: "ln(1 + e^x), x itself above 20 (PyTorch's threshold)",
    },
    OpSchema {
        name: "dt_proj",
        inputs: &["x_dbc", "weight", "bias?"],
        outputs: &["y"],
        required_attrs: &[],
        description: "Mamba's dt projection of the first R columns of x_proj's output",
    },
    OpSchema {
        name: "selective_scan",
        inputs: &["u", "dt", "A_log", "x_dbc", "D"],
        outputs: &["y", "states"],
        required_attrs: &["chunk"],
        description: "Mamba-1 scan h = exp(dt A) h + dt B u, y = C h + D u; keeps the state entering each chunk",
    },
    OpSchema {
        name: "mamba_gate",
        inputs: &["y", "xz"],
        outputs: &["out"],
        required_attrs: &[],
        description: "y * silu(z), z the last channels of in_proj's output",
    },
];

pub fn lookup(name: &str) -> Option<&'static OpSchema> {
    OPS.iter().find(|op| op.name == name)
}

pub fn known_names() -> String {
    let mut names: Vec<&str> = OPS.iter().map(|op| op.name).collect();
    names.push(REPLAY);
    names.join(", ")
}

/// LoRA adapter names a slot may list in `lora_targets`.
/// The Qwen3 projections, then Mamba's `in` (in_proj), `x` (x_proj) and `out` (out_proj).
pub const LORA_TARGETS: &[&str] = &["q", "k", "v", "o", "up", "gate", "down", "in", "x", "out"];
