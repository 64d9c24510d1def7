//! Qwen3-style dense and MoE decoder models whose blocks run through a compiled recompute
//! spec: the forward records every op into the layer's slots, the plan decides what each
//! layer keeps, offloads or drops, and backward rebuilds what it needs through the layer's
//! plan (see [`crate::spec::run::exec`]).
//!
//! Full fine-tuning trains every weight; LoRA mode trains only adapters on the attention
//! and MLP projections (routed experts carry none), with the base weights and norms frozen.

mod backward;
mod forward;
pub mod hf;
mod inspect;

use std::collections::BTreeMap;
use std::sync::Arc;

use super::spec_lora::{check_lora, init_adapters, trainable_values};
use crate::kernels::{self, RopeTable};
use crate::spec::compile::{Mode, Plan};
use crate::spec::run::exec::{Backward, Forward, LayerWeights, Scratch};
use crate::spec::run::lora::{AdapterGrad, LayerAdapters, LoraConfig};
use crate::spec::run::meter::{Hold, Meter, MeterStats, Use};
use crate::spec::run::ops::Act;
use crate::spec::run::{RunError, RunResult, linalg};
use crate::spec::{ModelConfig, Value};
use crate::swap::HostStore;

use super::spec_step::{
    BlockRunner, StackDims, UniformModel, check_stacked_plan, run_uniform_step,
};
pub(crate) use backward::LayerGrads;
pub use inspect::{RecomputeCheck, record_block};

/// Which block the model stacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    Dense,
    Moe,
}

impl BlockKind {
    pub fn spec_name(self) -> &'static str {
        match self {
            BlockKind::Dense => "qwen3",
            BlockKind::Moe => "qwen3-moe",
        }
    }

    /// The block named exactly `name` (`qwen3`, `qwen3-moe`).
    pub fn from_name(name: &str) -> Option<Self> {
        [BlockKind::Dense, BlockKind::Moe]
            .into_iter()
            .find(|k| k.spec_name() == name)
    }

    /// The block a spec is written for: its name is exactly the block's, or the block's
    /// with `-derived` (what `remat spec derive` writes) or `-save-all`
    /// ([`crate::spec::BlockSpec::save_everything`]). Never a prefix match: `qwen3` must
    /// not claim a `qwen3-moe` spec.
    pub fn of_spec(spec_name: &str) -> Option<Self> {
        let base = ["-derived", "-save-all"]
            .iter()
            .find_map(|suffix| spec_name.strip_suffix(suffix))
            .unwrap_or(spec_name);
        Self::from_name(base)
    }
}

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

    fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }

    fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    fn rows(&self) -> usize {
        self.batch * self.seq
    }
}

/// Deterministic uniform values in `[-scale, scale)` from a counter-based hash.
pub(crate) fn uniform(seed: u64, stream: u64, n: usize, scale: f32) -> RunResult<Vec<f32>> {
    filled(n, |i| {
        let bits = kernels::philox_hash(seed ^ (stream << 20), i as u64) >> 40;
        ((bits as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale
    })
}

/// `n` values from `value`, allocated fallibly: a size the machine cannot hold is an
/// error, not an abort of the process.
pub(crate) fn filled(n: usize, value: impl Fn(usize) -> f32) -> RunResult<Vec<f32>> {
    let mut data = Vec::new();
    data.try_reserve_exact(n).map_err(|_| {
        RunError::Model(format!(
            "cannot allocate a parameter of {n} values ({} bytes)",
            (n as u128) * 4
        ))
    })?;
    data.extend((0..n).map(value));
    Ok(data)
}

/// A Qwen3-style model: token embedding, blocks, final RMSNorm, LM head.
#[derive(Debug, Clone)]
pub struct Qwen3 {
    pub kind: BlockKind,
    pub dims: Qwen3Dims,
    pub config: ModelConfig,
    pub embed: Act,
    pub final_norm: Act,
    pub lm_head: Act,
    /// Per layer, parameters under the spec's `@param:` names.
    pub layers: Vec<BTreeMap<String, Act>>,
    pub lora: Option<(LoraConfig, Vec<LayerAdapters>)>,
}

/// Gradients of one step: every weight under full fine-tuning, adapters only under LoRA.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Qwen3Grads {
    pub embed: Vec<f32>,
    pub final_norm: Vec<f32>,
    pub lm_head: Vec<f32>,
    pub layers: Vec<BTreeMap<String, Vec<f32>>>,
    pub adapters: Vec<BTreeMap<String, AdapterGrad>>,
    /// The pool bytes these gradients hold, released when the last copy is dropped.
    pub held: GradHolds,
}

/// Pool reservations of a step's gradient buffers. Accounting, not values: two gradient
/// sets compare equal whatever they hold.
#[derive(Debug, Clone, Default)]
pub struct GradHolds(pub(crate) Arc<Vec<Hold>>);

impl GradHolds {
    /// Pool bytes held by the gradient buffers.
    pub fn bytes(&self) -> u64 {
        self.0.iter().map(Hold::bytes).sum()
    }
}

impl PartialEq for GradHolds {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Qwen3Grads {
    /// Every gradient buffer with a name, for comparisons and reports.
    pub fn named(&self) -> Vec<(String, &[f32])> {
        let mut out: Vec<(String, &[f32])> = vec![
            ("embed".into(), &self.embed),
            ("final_norm".into(), &self.final_norm),
            ("lm_head".into(), &self.lm_head),
        ];
        for (l, layer) in self.layers.iter().enumerate() {
            for (k, v) in layer {
                out.push((format!("layers.{l}.{k}"), v));
            }
        }
        for (l, layer) in self.adapters.iter().enumerate() {
            for (k, g) in layer {
                out.push((format!("layers.{l}.lora.{k}.A"), &g.a));
                out.push((format!("layers.{l}.lora.{k}.B"), &g.b));
            }
        }
        out
    }

    /// Names of the buffers whose bits differ from `other`'s.
    pub fn bit_diff(&self, other: &Qwen3Grads) -> Vec<String> {
        let theirs: BTreeMap<String, &[f32]> = other.named().into_iter().collect();
        let mut diff = Vec::new();
        for (name, ours) in self.named() {
            let same = theirs.get(&name).is_some_and(|t| {
                t.len() == ours.len() && t.iter().zip(ours).all(|(a, b)| a.to_bits() == b.to_bits())
            });
            if !same {
                diff.push(name);
            }
        }
        if theirs.len() != self.named().len() {
            diff.push("(different gradient sets)".into());
        }
        diff
    }
}

/// What one step measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    pub loss: f32,
    /// The pool over the step: its peak (activations, scratch, gradients, and whatever the
    /// caller registered, such as parameters), and the saved / shared breakdown.
    pub activations: MeterStats,
    pub host_peak: u64,
    pub recomputed_ops: usize,
}

/// What a step runs with besides the model, the plan and the batch.
#[derive(Clone, Copy)]
pub struct StepEnv<'a> {
    /// Where offloaded slots live between forward and backward.
    pub host: &'a HostStore,
    /// The pool (with its budget) every buffer of the step is charged to.
    pub meter: &'a Arc<Meter>,
    /// The training step: LoRA dropout draws a fresh mask each step, shared by the step's
    /// forward, recompute and backward.
    pub step: u64,
}

impl Qwen3 {
    /// A randomly initialised model (`seed`); `config` must carry `vocab_size`, `batch` and
    /// `seq_len` besides the Hugging Face keys.
    pub fn new(kind: BlockKind, config: &ModelConfig, seed: u64) -> RunResult<Self> {
        let dims = Qwen3Dims::from_config(config, kind)?;
        // Checked before anything is allocated: every product below then fits in a usize.
        dims.param_count(None)?;
        let d = &dims;
        let mut stream = 0u64;
        let mut param = |shape: Vec<usize>, fan_in: usize| -> RunResult<Act> {
            stream += 1;
            let n = shape.iter().product();
            Ok(Act::new(
                uniform(seed, stream, n, 1.0 / (fan_in as f32).sqrt())?,
                shape,
            ))
        };
        let embed = param(vec![d.vocab, d.hidden], 1)?;
        let lm_head = param(vec![d.vocab, d.hidden], d.hidden)?;
        let mut layers = Vec::with_capacity(d.layers);
        for _ in 0..d.layers {
            let mut p = BTreeMap::new();
            let ones = |n: usize| -> RunResult<Act> { Ok(Act::new(filled(n, |_| 1.0)?, vec![n])) };
            p.insert("input_layernorm".into(), ones(d.hidden)?);
            p.insert("post_attention_layernorm".into(), ones(d.hidden)?);
            p.insert(
                "q_proj".into(),
                param(vec![d.q_width(), d.hidden], d.hidden)?,
            );
            p.insert(
                "k_proj".into(),
                param(vec![d.kv_width(), d.hidden], d.hidden)?,
            );
            p.insert(
                "v_proj".into(),
                param(vec![d.kv_width(), d.hidden], d.hidden)?,
            );
            p.insert(
                "o_proj".into(),
                param(vec![d.hidden, d.q_width()], d.q_width())?,
            );
            if d.bias {
                p.insert("q_bias".into(), param(vec![d.q_width()], 16)?);
                p.insert("k_bias".into(), param(vec![d.kv_width()], 16)?);
                p.insert("v_bias".into(), param(vec![d.kv_width()], 16)?);
            }
            if d.qk_norm {
                // Not all ones, so a wrong QK-norm shows in the gradients.
                let mut w = param(vec![d.head_dim], 4)?;
                w.data.iter_mut().for_each(|x| *x += 1.0);
                p.insert("q_norm".into(), w.clone());
                p.insert("k_norm".into(), w);
            }
            match kind {
                BlockKind::Dense => {
                    p.insert(
                        "gate_proj".into(),
                        param(vec![d.intermediate, d.hidden], d.hidden)?,
                    );
                    p.insert(
                        "up_proj".into(),
                        param(vec![d.intermediate, d.hidden], d.hidden)?,
                    );
                    p.insert(
                        "down_proj".into(),
                        param(vec![d.hidden, d.intermediate], d.intermediate)?,
                    );
                }
                BlockKind::Moe => {
                    let (e, f) = (d.experts, d.moe_intermediate);
                    p.insert("router".into(), param(vec![e, d.hidden], d.hidden)?);
                    p.insert(
                        "experts_gate".into(),
                        param(vec![e, f, d.hidden], d.hidden)?,
                    );
                    p.insert("experts_up".into(), param(vec![e, f, d.hidden], d.hidden)?);
                    p.insert("experts_down".into(), param(vec![e, d.hidden, f], f)?);
                    if d.shared_intermediate > 0 {
                        let s = d.shared_intermediate;
                        p.insert(
                            "shared_gate_proj".into(),
                            param(vec![s, d.hidden], d.hidden)?,
                        );
                        p.insert("shared_up_proj".into(), param(vec![s, d.hidden], d.hidden)?);
                        p.insert("shared_down_proj".into(), param(vec![d.hidden, s], s)?);
                    }
                }
            }
            layers.push(p);
        }
        let final_norm = Act::new(filled(d.hidden, |_| 1.0)?, vec![d.hidden]);
        Ok(Self {
            kind,
            dims,
            config: config.clone(),
            embed,
            final_norm,
            lm_head,
            layers,
            lora: None,
        })
    }

    /// Adds LoRA adapters on `cfg.targets`. `A` starts random; `B` starts at zero as in
    /// the LoRA paper unless `random_b` (tests use it so adapters change the outputs).
    pub fn with_lora(mut self, cfg: LoraConfig, random_b: bool) -> RunResult<Self> {
        check_lora(&cfg)?;
        for t in &cfg.targets {
            if !crate::spec::ops::LORA_TARGETS.contains(&t.as_str()) {
                return Err(RunError::Model(format!(
                    "unknown LoRA target `{t}` (q, k, v, o, up, gate, down)"
                )));
            }
        }
        self.dims.param_count(Some((cfg.rank, &cfg.targets)))?;
        let adapters = init_adapters(&cfg, random_b, self.layers.len(), |l, t| {
            self.base_weight(&self.layers[l], t)
                .map(|w| (w.shape[0], w.shape[1]))
        })?;
        self.lora = Some((cfg, adapters));
        Ok(self)
    }

    /// The base projection a LoRA target attaches to (MoE: the shared expert's).
    fn base_weight<'a>(&self, layer: &'a BTreeMap<String, Act>, target: &str) -> Option<&'a Act> {
        let name = match (target, self.kind) {
            ("q" | "k" | "v" | "o", _) => format!("{target}_proj"),
            (_, BlockKind::Dense) => format!("{target}_proj"),
            (_, BlockKind::Moe) => format!("shared_{target}_proj"),
        };
        layer.get(&name)
    }

    /// The number of parameters trained in `mode`.
    pub fn trainable(&self, mode: Mode) -> usize {
        let adapters = self.lora.as_ref().map(|(_, a)| a.as_slice());
        let whole = [&self.embed, &self.final_norm, &self.lm_head];
        trainable_values(mode, adapters, &whole, &self.layers)
    }

    /// One forward and backward under `plan` (compiled from this block's spec for this
    /// model's config): loss, gradients and memory figures. Every buffer is charged to
    /// `env.meter`'s pool: over its budget the step fails with the engine's out-of-memory
    /// error naming the layer and slot.
    pub fn step(
        &self,
        plan: &Plan,
        tokens: &[u32],
        targets: &[u32],
        env: StepEnv,
    ) -> RunResult<(Qwen3Grads, StepStats)> {
        let d = &self.dims;
        self.check_plan(plan)?;
        self.check_batch(tokens, targets)?;
        let rope = RopeTable::<f32>::new(d.seq, d.head_dim, d.theta)
            .map_err(|e| RunError::Model(e.to_string()))?;
        let model = UniformModel {
            embed: &self.embed,
            head: LmHead {
                final_norm: &self.final_norm,
                lm_head: &self.lm_head,
                eps: d.eps,
            },
            batch: d.batch,
            seq: d.seq,
            layers: &self.layers,
            lora: self.lora.as_ref(),
            rope: Some(&rope),
        };
        run_uniform_step(model, plan, self, tokens, targets, env)
    }

    /// Checks that `plan` was compiled from a spec of this model's block, for its layer
    /// count, with dtypes the runtime runs and parameter shapes the model has.
    pub fn check_plan(&self, plan: &Plan) -> RunResult<()> {
        let d = &self.dims;
        let bad = |what: String| Err(RunError::Model(what));
        if BlockKind::of_spec(&plan.spec().name) != Some(self.kind) {
            return bad(format!(
                "plan is for block `{}`, the model stacks `{}`",
                plan.spec().name,
                self.kind.spec_name()
            ));
        }
        let dims = StackDims {
            layers: d.layers,
            batch: d.batch,
            seq: d.seq,
            hidden: d.hidden,
        };
        let reads = self.backward_reads();
        check_stacked_plan(plan, self.kind.spec_name(), &dims, &self.layers, &reads)
    }

    fn check_batch(&self, tokens: &[u32], targets: &[u32]) -> RunResult<()> {
        let d = &self.dims;
        if tokens.len() != d.rows() || targets.len() != d.rows() {
            return Err(RunError::Model(format!(
                "expected {} tokens and targets (batch {} x seq {}), got {} and {}",
                d.rows(),
                d.batch,
                d.seq,
                tokens.len(),
                targets.len()
            )));
        }
        Ok(())
    }

    fn weights(&self, layer: usize, lora: bool) -> LayerWeights<'_> {
        LayerWeights {
            params: &self.layers[layer],
            adapters: if lora {
                self.lora.as_ref().map(|(_, a)| &a[layer])
            } else {
                None
            },
        }
    }
}

impl Qwen3 {
    /// Layer 0's block input: the token embeddings, charged to the pool.
    pub(crate) fn embed_tokens(
        &self,
        tokens: &[u32],
        meter: &Arc<Meter>,
    ) -> RunResult<(Act, Hold)> {
        embed_tokens(&self.embed, [self.dims.batch, self.dims.seq], tokens, meter)
    }
}

impl BlockRunner for Qwen3 {
    fn forward(&self, _: usize, f: &mut Forward) -> RunResult<()> {
        self.block_forward(f)
    }

    fn backward(
        &self,
        _: usize,
        b: &mut Backward,
        dout: Scratch,
        g: &mut LayerGrads,
    ) -> RunResult<Scratch> {
        self.block_backward(b, dout, g)
    }
}

/// Token embeddings of `[batch, seq]` tokens from `embed` (`[vocab, hidden]`), charged to
/// the pool as layer 0's block input.
pub(crate) fn embed_tokens(
    embed: &Act,
    [batch, seq]: [usize; 2],
    tokens: &[u32],
    meter: &Arc<Meter>,
) -> RunResult<(Act, Hold)> {
    let (vocab, hidden) = (embed.shape[0], embed.shape[1]);
    let hold = meter.hold((tokens.len() * hidden * 4) as u64, Use::Forward, || {
        "embedding output (layer 0 block input `x`)".into()
    })?;
    let mut x = vec![0.0; tokens.len() * hidden];
    kernels::embedding_forward(&embed.data, vocab, hidden, tokens, &mut x)
        .map_err(kernel_err("embedding"))?;
    Ok((Act::new(x, vec![batch, seq, hidden]), hold))
}

/// The weights after the blocks: final RMSNorm and LM head (`[vocab, hidden]`).
#[derive(Clone, Copy)]
pub(crate) struct LmHead<'a> {
    pub final_norm: &'a Act,
    pub lm_head: &'a Act,
    pub eps: f64,
}

/// Final norm, LM head and mean cross-entropy, forward and backward (not spec-driven);
/// its buffers are charged to the pool like the blocks'.
pub(crate) fn lm_loss(
    head: LmHead,
    x: &Act,
    targets: &[u32],
    mode: Mode,
    meter: &Arc<Meter>,
    holds: &mut Vec<Hold>,
) -> RunResult<(f32, Scratch, Qwen3Grads)> {
    let (vocab, hidden) = (head.lm_head.shape[0], head.lm_head.shape[1]);
    let n = x.data.len() / hidden.max(1);
    let scratch =
        |len: usize, what: &'static str| Scratch::zeros(meter, len, || format!("LM head `{what}`"));
    let mut xf = scratch(x.data.len(), "final norm output")?;
    let mut rstd = scratch(n, "final norm rstd")?;
    kernels::rmsnorm_forward(&x.data, &head.final_norm.data, head.eps, &mut xf, &mut rstd)
        .map_err(kernel_err("final norm"))?;
    let mut logits = scratch(n * vocab, "logits")?;
    linalg::linear(
        &xf,
        &head.lm_head.data,
        n,
        hidden,
        vocab,
        &mut logits,
        false,
        1.0,
    );
    let mut lse = scratch(n, "logsumexp")?;
    let loss = kernels::cross_entropy_forward(&logits, targets, vocab, &mut lse)
        .map_err(kernel_err("cross-entropy"))?;
    let mut dlogits = scratch(logits.len(), "dlogits")?;
    kernels::cross_entropy_backward(&logits, targets, vocab, &lse, 1.0, &mut dlogits)
        .map_err(kernel_err("cross-entropy"))?;
    drop(logits);
    let mut grads = Qwen3Grads::default();
    let mut dxf = scratch(xf.len(), "dfinal norm output")?;
    linalg::linear_dx(
        &dlogits,
        &head.lm_head.data,
        n,
        hidden,
        vocab,
        &mut dxf,
        false,
        1.0,
    );
    let mut dnorm = vec![0.0; hidden];
    let mut dx = scratch(x.data.len(), "dx of the last block")?;
    kernels::rmsnorm_backward(
        &x.data,
        &head.final_norm.data,
        &rstd,
        &dxf,
        &mut dx,
        Some(&mut dnorm),
    )
    .map_err(kernel_err("final norm"))?;
    if mode == Mode::Full {
        let bytes = head.lm_head.bytes() + head.final_norm.bytes();
        holds.push(meter.hold(bytes, Use::Gradient, || {
            "gradients of `lm_head` and `final_norm`".into()
        })?);
        grads.lm_head = vec![0.0; head.lm_head.data.len()];
        linalg::linear_dw(&dlogits, &xf, n, hidden, vocab, &mut grads.lm_head, 1.0);
        grads.final_norm = dnorm;
    }
    Ok((loss, dx, grads))
}

pub(crate) fn kernel_err(what: &'static str) -> impl Fn(kernels::KernelError) -> RunError {
    move |e| RunError::Model(format!("{what}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::shipped::{QWEN3, QWEN3_MOE};

    fn config(kind: BlockKind, sets: &[&str]) -> ModelConfig {
        let shipped = match kind {
            BlockKind::Dense => &QWEN3,
            BlockKind::Moe => &QWEN3_MOE,
        };
        let mut c = shipped
            .config()
            .unwrap()
            .set("vocab_size", Value::Int(50))
            .set("num_hidden_layers", Value::Int(2));
        for s in sets {
            c.apply_override(s).unwrap();
        }
        c
    }

    fn targets() -> Vec<String> {
        ["q", "k", "v", "o", "gate", "up", "down"]
            .map(String::from)
            .to_vec()
    }

    /// The count the pool is charged before building is exactly what the model holds.
    #[test]
    fn param_count_matches_the_built_model() {
        for (kind, sets) in [
            (BlockKind::Dense, &["attention_bias=true"][..]),
            (BlockKind::Dense, &["use_qk_norm=false"]),
            (BlockKind::Moe, &["shared_expert_intermediate_size=16"]),
            (BlockKind::Moe, &[]),
        ] {
            let cfg = config(kind, sets);
            let lora = LoraConfig {
                rank: 3,
                alpha: 6.0,
                dropout: 0.0,
                targets: targets(),
                seed: 1,
            };
            let model = Qwen3::new(kind, &cfg, 0).unwrap();
            let count = model.dims.param_count(None).unwrap();
            assert_eq!(
                count,
                model.trainable(Mode::Full) as u64,
                "{kind:?} {sets:?}"
            );
            let model = model.with_lora(lora, false).unwrap();
            let with_lora = model
                .dims
                .param_count(Some((3, targets().as_slice())))
                .unwrap();
            assert_eq!(
                with_lora,
                (model.trainable(Mode::Full) + model.trainable(Mode::Lora)) as u64,
                "{kind:?} {sets:?}"
            );
        }
        let huge = Qwen3Dims::from_config(
            &config(
                BlockKind::Dense,
                &["hidden_size=4294967296", "intermediate_size=4294967296"],
            ),
            BlockKind::Dense,
        )
        .unwrap();
        assert!(huge.param_count(None).is_err());
    }

    /// Found by an audit: zero sizes panicked in kernels, a negative epsilon trained to NaN.
    #[test]
    fn zero_dims_and_bad_eps_are_refused() {
        for (set, key) in [
            ("num_hidden_layers=0", "num_hidden_layers"),
            ("vocab_size=0", "vocab_size"),
            ("seq_len=0", "seq_len"),
            ("batch=0", "batch"),
            ("hidden_size=0", "hidden_size"),
            ("num_attention_heads=0", "num_attention_heads"),
            ("num_key_value_heads=0", "num_key_value_heads"),
            ("head_dim=0", "head_dim"),
            ("intermediate_size=0", "intermediate_size"),
            ("rms_norm_eps=-1", "rms_norm_eps"),
            ("rms_norm_eps=0", "rms_norm_eps"),
        ] {
            let err = Qwen3Dims::from_config(&config(BlockKind::Dense, &[set]), BlockKind::Dense)
                .unwrap_err()
                .to_string();
            assert!(err.contains(key), "{set}: {err}");
        }
        let err =
            Qwen3Dims::from_config(&config(BlockKind::Moe, &["num_experts=0"]), BlockKind::Moe)
                .unwrap_err()
                .to_string();
        assert!(err.contains("num_experts"), "{err}");
    }

    /// Found by an audit: alpha NaN or infinite was accepted and trained to a NaN loss.
    #[test]
    fn lora_alpha_must_be_finite_and_positive() {
        let model = Qwen3::new(BlockKind::Dense, &config(BlockKind::Dense, &[]), 0).unwrap();
        for alpha in [f32::NAN, f32::INFINITY, 0.0, -2.0] {
            let lora = LoraConfig {
                rank: 2,
                alpha,
                dropout: 0.0,
                targets: targets(),
                seed: 1,
            };
            let err = model
                .clone()
                .with_lora(lora, false)
                .unwrap_err()
                .to_string();
            assert!(err.contains("alpha"), "{alpha}: {err}");
        }
    }
}
