//! The Qwen3 models' sizes and switches, read from a model config (Hugging Face key names)
//! and checked before anything is allocated, and the parameter count they imply.

use crate::spec::run::{RunError, RunResult};
use crate::spec::{ModelConfig, Value};

use super::BlockKind;

/// Every model-config key the Qwen3 models read (Hugging Face names, plus `batch` and
/// `seq_len`, which describe the run).
pub const CONFIG_KEYS: &[&str] = &[
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "num_hidden_layers",
    "num_layers",
    "rms_norm_eps",
    "rope_theta",
    "use_qk_norm",
    "attention_bias",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "shared_expert_intermediate_size",
    "batch",
    "seq_len",
];

/// Sizes and switches read from the model config (Hugging Face key names).
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen3Dims {
    pub vocab: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub eps: f64,
    pub theta: f64,
    pub qk_norm: bool,
    pub bias: bool,
    pub experts: usize,
    pub top_k: usize,
    pub moe_intermediate: usize,
    pub norm_topk: bool,
    /// Width of the shared expert; 0: none.
    pub shared_intermediate: usize,
    pub batch: usize,
    pub seq: usize,
}

fn flag(cfg: &ModelConfig, key: &str, default: bool) -> RunResult<bool> {
    match cfg.get(key) {
        None => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(RunError::Model(format!(
            "config {}: `{key}` = {other} is not a bool",
            cfg.source
        ))),
    }
}

fn float(cfg: &ModelConfig, key: &str, default: f64) -> RunResult<f64> {
    match cfg.get(key) {
        None => Ok(default),
        Some(Value::Float(x)) => Ok(*x),
        Some(Value::Int(i)) => Ok(*i as f64),
        Some(other) => Err(RunError::Model(format!(
            "config {}: `{key}` = {other} is not a number",
            cfg.source
        ))),
    }
}

impl Qwen3Dims {
    pub fn from_config(cfg: &ModelConfig, kind: BlockKind) -> RunResult<Self> {
        let n = |k: &str| cfg.usize_of(k, "qwen3 model").map_err(RunError::from);
        let moe = kind == BlockKind::Moe;
        // The shared expert exists when its width is set and positive (the spec's `when`).
        let shared = match cfg.get("shared_expert_intermediate_size") {
            Some(_) if moe => n("shared_expert_intermediate_size")?,
            _ => 0,
        };
        let dims = Self {
            vocab: n("vocab_size")?,
            hidden: n("hidden_size")?,
            heads: n("num_attention_heads")?,
            kv_heads: n("num_key_value_heads")?,
            head_dim: n("head_dim")?,
            intermediate: if moe { 0 } else { n("intermediate_size")? },
            layers: cfg.num_layers()?,
            eps: float(cfg, "rms_norm_eps", 1e-6)?,
            theta: float(cfg, "rope_theta", 1e6)?,
            qk_norm: flag(cfg, "use_qk_norm", true)?,
            bias: flag(cfg, "attention_bias", false)?,
            experts: if moe { n("num_experts")? } else { 0 },
            top_k: if moe { n("num_experts_per_tok")? } else { 0 },
            moe_intermediate: if moe { n("moe_intermediate_size")? } else { 0 },
            norm_topk: flag(cfg, "norm_topk_prob", true)?,
            shared_intermediate: shared,
            batch: n("batch")?,
            seq: n("seq_len")?,
        };
        dims.check(cfg, kind)?;
        Ok(dims)
    }

    /// Every size the model allocates or divides by must be positive, and the norm epsilon
    /// and RoPE base finite and positive: a zero dimension would otherwise surface as an
    /// index or slice panic deep in a kernel, and a negative epsilon as a NaN loss.
    fn check(&self, cfg: &ModelConfig, kind: BlockKind) -> RunResult<()> {
        let mut sizes = vec![
            ("num_hidden_layers", self.layers),
            ("vocab_size", self.vocab),
            ("batch", self.batch),
            ("seq_len", self.seq),
            ("hidden_size", self.hidden),
            ("num_attention_heads", self.heads),
            ("num_key_value_heads", self.kv_heads),
            ("head_dim", self.head_dim),
        ];
        match kind {
            BlockKind::Dense => sizes.push(("intermediate_size", self.intermediate)),
            BlockKind::Moe => sizes.extend([
                ("num_experts", self.experts),
                ("num_experts_per_tok", self.top_k),
                ("moe_intermediate_size", self.moe_intermediate),
            ]),
        }
        if let Some((key, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return Err(RunError::Model(format!(
                "config {}: `{key}` = 0: every model dimension must be at least 1",
                cfg.source
            )));
        }
        for (key, value) in [("rms_norm_eps", self.eps), ("rope_theta", self.theta)] {
            if !(value.is_finite() && value > 0.0) {
                return Err(RunError::Model(format!(
                    "config {}: `{key}` = {value}: must be a finite number greater than 0",
                    cfg.source
                )));
            }
        }
        Ok(())
    }

    /// How many f32 values the model's parameters hold, with LoRA adapters of `(rank,
    /// targets)` if given, computed without allocating anything; an error when the count
    /// overflows. Four times this is what the model's parameters take from the pool.
    pub fn param_count(&self, lora: Option<(usize, &[String])>) -> RunResult<u64> {
        self.checked_param_count(lora).ok_or_else(|| {
            RunError::Model(format!(
                "the model's parameters overflow a 64-bit count (hidden {}, {} layers, vocab {}, head_dim {}{})",
                self.hidden,
                self.layers,
                self.vocab,
                self.head_dim,
                lora.map_or(String::new(), |(rank, _)| format!(", LoRA rank {rank}"))
            ))
        })
    }

    fn checked_param_count(&self, lora: Option<(usize, &[String])>) -> Option<u64> {
        let mul = |dims: &[usize]| {
            dims.iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
        };
        let sum =
            |terms: &[Option<u64>]| terms.iter().try_fold(0u64, |acc, t| acc.checked_add((*t)?));
        let (h, q, kv) = (
            self.hidden,
            mul(&[self.heads, self.head_dim])?,
            mul(&[self.kv_heads, self.head_dim])?,
        );
        // Rows stay in usize elsewhere: they must fit.
        usize::try_from(q).ok()?;
        usize::try_from(kv).ok()?;
        let (q, kv) = (q as usize, kv as usize);
        let bias = if self.bias { q.checked_add(2 * kv)? } else { 0 };
        let qk_norm = if self.qk_norm { 2 * self.head_dim } else { 0 };
        let mlp = match self.experts {
            0 => mul(&[3, self.intermediate, h])?,
            e => sum(&[
                mul(&[e, h]),
                mul(&[3, e, self.moe_intermediate, h]),
                mul(&[3, self.shared_intermediate, h]),
            ])?,
        };
        let per_layer = sum(&[
            mul(&[2, h]),
            mul(&[q, h]),
            mul(&[2, kv, h]),
            mul(&[h, q]),
            Some(bias as u64),
            Some(qk_norm as u64),
            Some(mlp),
        ])?;
        let adapters = match lora {
            None => 0,
            Some((rank, targets)) => {
                let (f, moe) = match self.experts {
                    0 => (self.intermediate, false),
                    _ => (self.shared_intermediate, true),
                };
                let mut total = 0u64;
                for t in targets {
                    let (out, inp) = match t.as_str() {
                        "q" => (q, h),
                        "k" | "v" => (kv, h),
                        "o" => (h, q),
                        "gate" | "up" if !(moe && f == 0) => (f, h),
                        "down" if !(moe && f == 0) => (h, f),
                        _ => continue,
                    };
                    total = total.checked_add(mul(&[rank, out.checked_add(inp)?])?)?;
                }
                total
            }
        };
        sum(&[
            mul(&[2, self.vocab, h]),
            Some(h as u64),
            mul(&[self.layers]).and_then(|l| l.checked_mul(per_layer.checked_add(adapters)?)),
        ])
    }

    pub(super) fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }

    pub(super) fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    pub(super) fn rows(&self) -> usize {
        self.batch * self.seq
    }
}
