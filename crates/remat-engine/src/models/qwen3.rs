//! Qwen3-style dense and MoE decoder models whose blocks run through a compiled recompute
//! spec: the forward records every op into the layer's slots, the plan decides what each
//! layer keeps, offloads or drops, and backward rebuilds what it needs through the layer's
//! plan (see [`crate::spec::run::exec`]).
//!
//! Full fine-tuning trains every weight; LoRA mode trains only adapters on the attention
//! and MLP projections (routed experts carry none), with the base weights and norms frozen.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::kernels::{self, RopeTable};
use crate::spec::compile::{Mode, Plan};
use crate::spec::run::exec::{
    Backward, Forward, LayerState, LayerWeights, Record, Shared, SharedBuffers, Src,
};
use crate::spec::run::lora::{self, Adapter, AdapterGrad, LayerAdapters, LoraConfig};
use crate::spec::run::meter::{Meter, MeterStats};
use crate::spec::run::moe;
use crate::spec::run::ops::{self, Act};
use crate::spec::run::{RunError, RunResult, linalg};
use crate::spec::{ModelConfig, Value};
use crate::swap::HostStore;

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
}

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
        let use_shared = moe && flag(cfg, "use_shared_expert", false)?;
        Ok(Self {
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
            shared_intermediate: if use_shared {
                n("shared_expert_intermediate_size")?
            } else {
                0
            },
            batch: n("batch")?,
            seq: n("seq_len")?,
        })
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
fn uniform(seed: u64, stream: u64, n: usize, scale: f32) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let bits = kernels::philox_hash(seed ^ (stream << 20), i) >> 40;
            ((bits as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale
        })
        .collect()
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
    /// Device bytes the runtime held for block activations (saved, shared, prefetched).
    pub activations: MeterStats,
    pub host_peak: u64,
    pub recomputed_ops: usize,
}

impl Qwen3 {
    /// A randomly initialised model (`seed`); `config` must carry `vocab_size`, `batch` and
    /// `seq_len` besides the Hugging Face keys.
    pub fn new(kind: BlockKind, config: &ModelConfig, seed: u64) -> RunResult<Self> {
        let dims = Qwen3Dims::from_config(config, kind)?;
        let d = &dims;
        let mut stream = 0u64;
        let mut param = |shape: Vec<usize>, fan_in: usize| {
            stream += 1;
            let n = shape.iter().product();
            Act::new(
                uniform(seed, stream, n, 1.0 / (fan_in as f32).sqrt()),
                shape,
            )
        };
        let embed = param(vec![d.vocab, d.hidden], 1);
        let lm_head = param(vec![d.vocab, d.hidden], d.hidden);
        let mut layers = Vec::with_capacity(d.layers);
        for _ in 0..d.layers {
            let mut p = BTreeMap::new();
            let ones = |n: usize| Act::new(vec![1.0; n], vec![n]);
            p.insert("input_layernorm".into(), ones(d.hidden));
            p.insert("post_attention_layernorm".into(), ones(d.hidden));
            p.insert(
                "q_proj".into(),
                param(vec![d.q_width(), d.hidden], d.hidden),
            );
            p.insert(
                "k_proj".into(),
                param(vec![d.kv_width(), d.hidden], d.hidden),
            );
            p.insert(
                "v_proj".into(),
                param(vec![d.kv_width(), d.hidden], d.hidden),
            );
            p.insert(
                "o_proj".into(),
                param(vec![d.hidden, d.q_width()], d.q_width()),
            );
            if d.bias {
                p.insert("q_bias".into(), param(vec![d.q_width()], 16));
                p.insert("k_bias".into(), param(vec![d.kv_width()], 16));
                p.insert("v_bias".into(), param(vec![d.kv_width()], 16));
            }
            if d.qk_norm {
                // Not all ones, so a wrong QK-norm shows in the gradients.
                let mut w = param(vec![d.head_dim], 4);
                w.data.iter_mut().for_each(|x| *x += 1.0);
                p.insert("q_norm".into(), w.clone());
                p.insert("k_norm".into(), w);
            }
            match kind {
                BlockKind::Dense => {
                    p.insert(
                        "gate_proj".into(),
                        param(vec![d.intermediate, d.hidden], d.hidden),
                    );
                    p.insert(
                        "up_proj".into(),
                        param(vec![d.intermediate, d.hidden], d.hidden),
                    );
                    p.insert(
                        "down_proj".into(),
                        param(vec![d.hidden, d.intermediate], d.intermediate),
                    );
                }
                BlockKind::Moe => {
                    let (e, f) = (d.experts, d.moe_intermediate);
                    p.insert("router".into(), param(vec![e, d.hidden], d.hidden));
                    p.insert("experts_gate".into(), param(vec![e, f, d.hidden], d.hidden));
                    p.insert("experts_up".into(), param(vec![e, f, d.hidden], d.hidden));
                    p.insert("experts_down".into(), param(vec![e, d.hidden, f], f));
                    if d.shared_intermediate > 0 {
                        let s = d.shared_intermediate;
                        p.insert(
                            "shared_gate_proj".into(),
                            param(vec![s, d.hidden], d.hidden),
                        );
                        p.insert("shared_up_proj".into(), param(vec![s, d.hidden], d.hidden));
                        p.insert("shared_down_proj".into(), param(vec![d.hidden, s], s));
                    }
                }
            }
            layers.push(p);
        }
        let final_norm = Act::new(vec![1.0; d.hidden], vec![d.hidden]);
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
        if cfg.rank == 0 || !(0.0..1.0).contains(&cfg.dropout) {
            return Err(RunError::Model(format!(
                "LoRA needs rank > 0 and dropout in [0, 1) (got rank {}, dropout {})",
                cfg.rank, cfg.dropout
            )));
        }
        for t in &cfg.targets {
            if !crate::spec::ops::LORA_TARGETS.contains(&t.as_str()) {
                return Err(RunError::Model(format!(
                    "unknown LoRA target `{t}` (q, k, v, o, up, gate, down)"
                )));
            }
        }
        let mut adapters = Vec::with_capacity(self.layers.len());
        let mut stream = 1000u64;
        for layer in &self.layers {
            let mut map = LayerAdapters::new();
            for t in &cfg.targets {
                let Some(w) = self.base_weight(layer, t) else {
                    continue;
                };
                let (out, inp) = (w.shape[0], w.shape[1]);
                stream += 2;
                let a = Act::new(
                    uniform(cfg.seed, stream, cfg.rank * inp, 1.0 / (inp as f32).sqrt()),
                    vec![cfg.rank, inp],
                );
                let b_data = if random_b {
                    uniform(cfg.seed, stream + 1, out * cfg.rank, 0.5)
                } else {
                    vec![0.0; out * cfg.rank]
                };
                map.insert(
                    t.clone(),
                    Adapter {
                        a,
                        b: Act::new(b_data, vec![out, cfg.rank]),
                    },
                );
            }
            adapters.push(map);
        }
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
        match (mode, &self.lora) {
            (Mode::Lora, Some((_, adapters))) => adapters
                .iter()
                .flat_map(|m| m.values())
                .map(|a| a.a.data.len() + a.b.data.len())
                .sum(),
            (Mode::Lora, None) => 0,
            (Mode::Full, _) => {
                self.embed.data.len()
                    + self.final_norm.data.len()
                    + self.lm_head.data.len()
                    + self
                        .layers
                        .iter()
                        .flat_map(|m| m.values())
                        .map(|a| a.data.len())
                        .sum::<usize>()
            }
        }
    }

    /// One forward and backward under `plan` (compiled from this block's spec for this
    /// model's config): loss, gradients and memory figures.
    pub fn step(
        &self,
        plan: &Plan,
        tokens: &[u32],
        targets: &[u32],
        host: &HostStore,
        meter: &Arc<Meter>,
    ) -> RunResult<(Qwen3Grads, StepStats)> {
        let d = &self.dims;
        self.check_plan(plan, tokens, targets)?;
        let rope = RopeTable::<f32>::new(d.seq, d.head_dim, d.theta)
            .map_err(|e| RunError::Model(e.to_string()))?;
        let lora_cfg = match plan.mode {
            Mode::Lora => Some(
                &self
                    .lora
                    .as_ref()
                    .ok_or_else(|| RunError::Model("LoRA mode needs adapters (with_lora)".into()))?
                    .0,
            ),
            Mode::Full => None,
        };
        let shared = Shared {
            plan,
            config: &plan.config,
            rope: &rope,
            lora: lora_cfg,
            meter,
            host,
        };
        meter.reset_peak();
        host.reset_peak();
        let mut x = vec![0.0; tokens.len() * d.hidden];
        kernels::embedding_forward(&self.embed.data, d.vocab, d.hidden, tokens, &mut x)
            .map_err(kernel_err("embedding"))?;
        let mut x = Act::new(x, vec![d.batch, d.seq, d.hidden]);
        let mut states: Vec<LayerState> = Vec::with_capacity(d.layers);
        for l in 0..d.layers {
            let inputs = BTreeMap::from([("x".to_string(), x)]);
            let mut f = Forward::new(&shared, l, self.weights(l, lora_cfg.is_some()), inputs);
            self.block_forward(&mut f)?;
            let (out, state) = f.finish("out")?;
            states.push(state);
            x = out;
        }
        let (loss, dx_final, mut grads) = self.head(&x, targets, plan.mode)?;
        let mut dx = dx_final;
        let mut buffers = SharedBuffers::new();
        let mut recomputed_ops = 0;
        grads.layers = vec![BTreeMap::new(); d.layers];
        grads.adapters = vec![BTreeMap::new(); d.layers];
        for l in (0..d.layers).rev() {
            let state = states
                .pop()
                .ok_or_else(|| RunError::Model("lost a layer's state".into()))?;
            let mut b = Backward::new(
                &shared,
                self.weights(l, lora_cfg.is_some()),
                state,
                &mut buffers,
            )?;
            let mut lg = LayerGrads {
                params: &mut grads.layers[l],
                adapters: &mut grads.adapters[l],
            };
            dx = self.block_backward(&mut b, dx, &mut lg)?;
            recomputed_ops += b.recomputed_ops;
        }
        drop(buffers);
        if plan.mode == Mode::Full {
            grads.embed = vec![0.0; self.embed.data.len()];
            kernels::embedding_backward(tokens, &dx, d.vocab, d.hidden, &mut grads.embed)
                .map_err(kernel_err("embedding"))?;
        } else {
            grads.layers.iter_mut().for_each(BTreeMap::clear);
        }
        let stats = StepStats {
            loss,
            activations: meter.stats(),
            host_peak: host.stats().peak_bytes,
            recomputed_ops,
        };
        Ok((grads, stats))
    }

    fn check_plan(&self, plan: &Plan, tokens: &[u32], targets: &[u32]) -> RunResult<()> {
        let d = &self.dims;
        let bad = |what: String| Err(RunError::Model(what));
        if plan.spec().name != self.kind.spec_name()
            && !plan.spec().name.starts_with(self.kind.spec_name())
        {
            return bad(format!(
                "plan is for block `{}`, the model stacks `{}`",
                plan.spec().name,
                self.kind.spec_name()
            ));
        }
        if plan.layers.len() != d.layers {
            return bad(format!(
                "plan has {} layers, the model {}",
                plan.layers.len(),
                d.layers
            ));
        }
        if tokens.len() != d.rows() || targets.len() != d.rows() {
            return bad(format!(
                "expected {} tokens and targets (batch {} x seq {}), got {} and {}",
                d.rows(),
                d.batch,
                d.seq,
                tokens.len(),
                targets.len()
            ));
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

    /// Final norm, LM head and mean cross-entropy, forward and backward (not spec-driven).
    fn head(&self, x: &Act, targets: &[u32], mode: Mode) -> RunResult<(f32, Vec<f32>, Qwen3Grads)> {
        let d = &self.dims;
        let n = d.rows();
        let mut xf = vec![0.0; x.data.len()];
        let mut rstd = vec![0.0; n];
        kernels::rmsnorm_forward(&x.data, &self.final_norm.data, d.eps, &mut xf, &mut rstd)
            .map_err(kernel_err("final norm"))?;
        let mut logits = vec![0.0; n * d.vocab];
        linalg::linear(
            &xf,
            &self.lm_head.data,
            n,
            d.hidden,
            d.vocab,
            &mut logits,
            false,
            1.0,
        );
        let mut lse = vec![0.0; n];
        let loss = kernels::cross_entropy_forward(&logits, targets, d.vocab, &mut lse)
            .map_err(kernel_err("cross-entropy"))?;
        let mut dlogits = vec![0.0; logits.len()];
        kernels::cross_entropy_backward(&logits, targets, d.vocab, &lse, 1.0, &mut dlogits)
            .map_err(kernel_err("cross-entropy"))?;
        let mut grads = Qwen3Grads::default();
        let mut dxf = vec![0.0; xf.len()];
        linalg::linear_dx(
            &dlogits,
            &self.lm_head.data,
            n,
            d.hidden,
            d.vocab,
            &mut dxf,
            false,
            1.0,
        );
        let mut dnorm = vec![0.0; d.hidden];
        let mut dx = vec![0.0; x.data.len()];
        kernels::rmsnorm_backward(
            &x.data,
            &self.final_norm.data,
            &rstd,
            &dxf,
            &mut dx,
            &mut dnorm,
        )
        .map_err(kernel_err("final norm"))?;
        if mode == Mode::Full {
            grads.lm_head = vec![0.0; self.lm_head.data.len()];
            linalg::linear_dw(&dlogits, &xf, n, d.hidden, d.vocab, &mut grads.lm_head, 1.0);
            grads.final_norm = dnorm;
        }
        Ok((loss, dx, grads))
    }
}

fn kernel_err(what: &'static str) -> impl Fn(kernels::KernelError) -> RunError {
    move |e| RunError::Model(format!("{what}: {e}"))
}

/// Where one layer's backward writes its gradients.
struct LayerGrads<'g> {
    params: &'g mut BTreeMap<String, Vec<f32>>,
    adapters: &'g mut BTreeMap<String, AdapterGrad>,
}

impl LayerGrads<'_> {
    fn param(&mut self, name: &str, len: usize) -> &mut Vec<f32> {
        self.params
            .entry(name.to_string())
            .or_insert_with(|| vec![0.0; len])
    }
}

fn eps() -> (&'static str, Value) {
    ("eps", Value::Str("rms_norm_eps".into()))
}

impl Qwen3 {
    /// The block's forward as op calls: the slot names are the spec's.
    fn block_forward(&self, f: &mut Forward) -> RunResult<()> {
        use Src::{Global, Input, OptParam, Param, Slot};
        let d = &self.dims;
        f.call(
            "rmsnorm",
            &[eps()],
            &[Input("x"), Param("input_layernorm")],
            &["ln1", "ln1_rstd"],
            &[],
        )?;
        f.call(
            "qkv_proj",
            &[],
            &[
                Slot("ln1"),
                Param("q_proj"),
                Param("k_proj"),
                Param("v_proj"),
                OptParam("q_bias"),
                OptParam("k_bias"),
                OptParam("v_bias"),
            ],
            &["q_lin", "k_lin", "v"],
            &[Some("q"), Some("k"), Some("v")],
        )?;
        let (q_in, k_in) = if d.qk_norm {
            f.call(
                "head_rmsnorm",
                &[eps()],
                &[Slot("q_lin"), Param("q_norm")],
                &["q_normed", "q_rstd"],
                &[],
            )?;
            f.call(
                "head_rmsnorm",
                &[eps()],
                &[Slot("k_lin"), Param("k_norm")],
                &["k_normed", "k_rstd"],
                &[],
            )?;
            ("q_normed", "k_normed")
        } else {
            ("q_lin", "k_lin")
        };
        let hd = [("head_dim", Value::Str("head_dim".into()))];
        f.call(
            "rope",
            &hd,
            &[Slot(q_in), Global("rope_cos"), Global("rope_sin")],
            &["q"],
            &[],
        )?;
        f.call(
            "rope",
            &hd,
            &[Slot(k_in), Global("rope_cos"), Global("rope_sin")],
            &["k"],
            &[],
        )?;
        let heads = [
            ("heads", Value::Str("num_attention_heads".into())),
            ("kv_heads", Value::Str("num_key_value_heads".into())),
        ];
        f.call(
            "attention",
            &heads,
            &[Slot("q"), Slot("k"), Slot("v")],
            &["attn", "attn_lse"],
            &[],
        )?;
        f.call(
            "linear",
            &[],
            &[Slot("attn"), Param("o_proj")],
            &["attn_proj"],
            &[Some("o")],
        )?;
        f.call("add", &[], &[Input("x"), Slot("attn_proj")], &["h"], &[])?;
        f.call(
            "rmsnorm",
            &[eps()],
            &[Slot("h"), Param("post_attention_layernorm")],
            &["ln2", "ln2_rstd"],
            &[],
        )?;
        match self.kind {
            BlockKind::Dense => {
                f.call(
                    "linear",
                    &[],
                    &[Slot("ln2"), Param("gate_proj")],
                    &["gate"],
                    &[Some("gate")],
                )?;
                f.call(
                    "linear",
                    &[],
                    &[Slot("ln2"), Param("up_proj")],
                    &["up"],
                    &[Some("up")],
                )?;
                f.call("swiglu", &[], &[Slot("gate"), Slot("up")], &["act"], &[])?;
                f.call(
                    "linear",
                    &[],
                    &[Slot("act"), Param("down_proj")],
                    &["mlp_out"],
                    &[Some("down")],
                )?;
                f.call("add", &[], &[Slot("h"), Slot("mlp_out")], &["out"], &[])
            }
            BlockKind::Moe => {
                f.call(
                    "linear",
                    &[],
                    &[Slot("ln2"), Param("router")],
                    &["router_logits"],
                    &[],
                )?;
                let topk = [
                    ("k", Value::Str("num_experts_per_tok".into())),
                    ("normalize", Value::Str("norm_topk_prob".into())),
                ];
                f.call(
                    "topk_softmax",
                    &topk,
                    &[Slot("router_logits")],
                    &["topk_weights", "topk_experts"],
                    &[],
                )?;
                f.call(
                    "moe_gate_up",
                    &[],
                    &[
                        Slot("ln2"),
                        Slot("topk_experts"),
                        Param("experts_gate"),
                        Param("experts_up"),
                    ],
                    &["expert_gate", "expert_up"],
                    &[],
                )?;
                f.call(
                    "swiglu",
                    &[],
                    &[Slot("expert_gate"), Slot("expert_up")],
                    &["expert_act"],
                    &[],
                )?;
                f.call(
                    "moe_down",
                    &[],
                    &[
                        Slot("expert_act"),
                        Slot("topk_experts"),
                        Param("experts_down"),
                    ],
                    &["expert_out"],
                    &[],
                )?;
                if d.shared_intermediate > 0 {
                    f.call(
                        "linear",
                        &[],
                        &[Slot("ln2"), Param("shared_gate_proj")],
                        &["shared_gate"],
                        &[Some("gate")],
                    )?;
                    f.call(
                        "linear",
                        &[],
                        &[Slot("ln2"), Param("shared_up_proj")],
                        &["shared_up"],
                        &[Some("up")],
                    )?;
                    f.call(
                        "swiglu",
                        &[],
                        &[Slot("shared_gate"), Slot("shared_up")],
                        &["shared_act"],
                        &[],
                    )?;
                    f.call(
                        "linear",
                        &[],
                        &[Slot("shared_act"), Param("shared_down_proj")],
                        &["shared_out"],
                        &[Some("down")],
                    )?;
                    f.call(
                        "moe_combine",
                        &[],
                        &[Slot("expert_out"), Slot("topk_weights"), Slot("shared_out")],
                        &["moe_out"],
                        &[],
                    )?;
                } else {
                    f.call(
                        "moe_combine",
                        &[],
                        &[Slot("expert_out"), Slot("topk_weights")],
                        &["moe_out"],
                        &[],
                    )?;
                }
                // moe_combine yields [tokens, hidden]; the residual add keeps h's shape.
                f.call("add", &[], &[Slot("h"), Slot("moe_out")], &["out"], &[])
            }
        }
    }

    /// Backward of one linear use: `dx (+)= dy W` (+ the adapter's input gradient); in full
    /// mode `dW += dy^T x` (and the bias); in LoRA mode the adapter's gradients.
    #[allow(clippy::too_many_arguments)]
    fn linear_backward(
        &self,
        b: &Backward,
        g: &mut LayerGrads,
        x_slot: &str,
        w_name: &str,
        bias: Option<&str>,
        target: Option<&str>,
        dy: &[f32],
        dx: &mut [f32],
        accumulate: bool,
    ) -> RunResult<()> {
        let w = b.weights().params.get(w_name).ok_or_else(|| {
            RunError::Model(format!("layer {}: no parameter `{w_name}`", b.layer))
        })?;
        let (n, k) = (w.shape[0], w.shape[1]);
        let m = dy.len() / n;
        linalg::linear_dx(dy, &w.data, m, k, n, dx, accumulate, 1.0);
        match b.mode() {
            Mode::Full => {
                let x = b.get(x_slot)?;
                linalg::linear_dw(dy, &x.data, m, k, n, g.param(w_name, w.data.len()), 1.0);
                if let Some(bias) = bias.filter(|name| b.weights().params.contains_key(*name)) {
                    let db = g.param(bias, n);
                    for row in dy.chunks(n) {
                        for (o, v) in db.iter_mut().zip(row) {
                            *o += v;
                        }
                    }
                }
            }
            Mode::Lora => {
                let adapter = target.and_then(|t| b.weights().adapters.and_then(|a| a.get(t)));
                if let (Some(t), Some(adapter), Some(cfg)) = (target, adapter, b.lora_config()) {
                    let x = b.get(x_slot)?;
                    let grad = g
                        .adapters
                        .entry(t.to_string())
                        .or_insert_with(|| AdapterGrad {
                            a: vec![0.0; adapter.a.data.len()],
                            b: vec![0.0; adapter.b.data.len()],
                        });
                    lora::backward(cfg, b.layer, t, adapter, &x.data, dy, dx, grad);
                }
            }
        }
        Ok(())
    }

    /// RMSNorm backward: returns dx; accumulates the weight gradient in full mode.
    fn norm_backward(
        &self,
        b: &Backward,
        g: &mut LayerGrads,
        x: &str,
        w_name: &str,
        rstd: &str,
        dy: &[f32],
    ) -> RunResult<Vec<f32>> {
        let w = &b.weights().params[w_name];
        let mut dx = vec![0.0; dy.len()];
        let mut dw = vec![0.0; w.data.len()];
        kernels::rmsnorm_backward(
            &b.get(x)?.data,
            &w.data,
            &b.get(rstd)?.data,
            dy,
            &mut dx,
            &mut dw,
        )
        .map_err(kernel_err("rmsnorm"))?;
        if b.mode() == Mode::Full {
            for (o, v) in g.param(w_name, dw.len()).iter_mut().zip(&dw) {
                *o += v;
            }
        }
        Ok(dx)
    }

    fn block_backward(
        &self,
        b: &mut Backward,
        dout: Vec<f32>,
        g: &mut LayerGrads,
    ) -> RunResult<Vec<f32>> {
        let dln2 = match self.kind {
            BlockKind::Dense => self.dense_mlp_backward(b, g, &dout)?,
            BlockKind::Moe => self.moe_backward(b, g, &dout)?,
        };
        let dh_norm =
            self.norm_backward(b, g, "h", "post_attention_layernorm", "ln2_rstd", &dln2)?;
        let dh: Vec<f32> = dout.iter().zip(&dh_norm).map(|(a, c)| a + c).collect();
        self.attention_backward(b, g, dh)
    }

    fn dense_mlp_backward(
        &self,
        b: &mut Backward,
        g: &mut LayerGrads,
        dout: &[f32],
    ) -> RunResult<Vec<f32>> {
        let d = &self.dims;
        b.ensure(&["act", "gate", "up", "ln2", "h", "ln2_rstd"])?;
        let n = d.rows();
        let mut dact = vec![0.0; n * d.intermediate];
        self.linear_backward(
            b,
            g,
            "act",
            "down_proj",
            None,
            Some("down"),
            dout,
            &mut dact,
            false,
        )?;
        let (mut dgate, mut dup) = (vec![0.0; dact.len()], vec![0.0; dact.len()]);
        kernels::swiglu_backward(
            &b.get("gate")?.data,
            &b.get("up")?.data,
            &dact,
            &mut dgate,
            &mut dup,
        )
        .map_err(kernel_err("swiglu"))?;
        let mut dln2 = vec![0.0; n * d.hidden];
        self.linear_backward(
            b,
            g,
            "ln2",
            "gate_proj",
            None,
            Some("gate"),
            &dgate,
            &mut dln2,
            false,
        )?;
        self.linear_backward(
            b,
            g,
            "ln2",
            "up_proj",
            None,
            Some("up"),
            &dup,
            &mut dln2,
            true,
        )?;
        Ok(dln2)
    }

    fn moe_backward(
        &self,
        b: &mut Backward,
        g: &mut LayerGrads,
        dout: &[f32],
    ) -> RunResult<Vec<f32>> {
        let d = &self.dims;
        let shared = d.shared_intermediate > 0;
        let mut needed = vec![
            "ln2",
            "h",
            "ln2_rstd",
            "router_logits",
            "topk_weights",
            "topk_experts",
            "expert_gate",
            "expert_up",
            "expert_act",
            "expert_out",
        ];
        if shared {
            needed.extend(["shared_gate", "shared_up", "shared_act"]);
        }
        b.ensure(&needed)?;
        let full = b.mode() == Mode::Full;
        let (deo, dweights) =
            moe::combine_backward(b.get("expert_out")?, b.get("topk_weights")?, dout);
        let p = b.weights().params;
        let err = |e: String| RunError::Model(format!("layer {}: {e}", b.layer));
        let (wd, wg, wu) = (&p["experts_down"], &p["experts_gate"], &p["experts_up"]);
        let mut dact = vec![0.0; b.get("expert_act")?.data.len()];
        let mut dwd = full.then(|| vec![0.0; wd.data.len()]);
        moe::down_backward(
            b.get("expert_act")?,
            b.get("topk_experts")?,
            wd,
            &deo,
            &mut dact,
            dwd.as_deref_mut(),
        )
        .map_err(err)?;
        let (mut deg, mut deu) = (vec![0.0; dact.len()], vec![0.0; dact.len()]);
        kernels::swiglu_backward(
            &b.get("expert_gate")?.data,
            &b.get("expert_up")?.data,
            &dact,
            &mut deg,
            &mut deu,
        )
        .map_err(kernel_err("swiglu"))?;
        let mut dln2 = vec![0.0; d.rows() * d.hidden];
        let (mut dwg, mut dwu) = (
            vec![0.0; if full { wg.data.len() } else { 0 }],
            vec![0.0; if full { wu.data.len() } else { 0 }],
        );
        let dws = full.then_some((dwg.as_mut_slice(), dwu.as_mut_slice()));
        moe::gate_up_backward(
            b.get("ln2")?,
            b.get("topk_experts")?,
            wg,
            wu,
            &deg,
            &deu,
            &mut dln2,
            dws,
        )
        .map_err(err)?;
        let dlogits = moe::topk_softmax_backward(
            b.get("router_logits")?,
            b.get("topk_experts")?,
            &dweights,
            d.norm_topk,
        );
        self.linear_backward(b, g, "ln2", "router", None, None, &dlogits, &mut dln2, true)?;
        if shared {
            let mut dsa = vec![0.0; d.rows() * d.shared_intermediate];
            self.linear_backward(
                b,
                g,
                "shared_act",
                "shared_down_proj",
                None,
                Some("down"),
                dout,
                &mut dsa,
                false,
            )?;
            let (mut dsg, mut dsu) = (vec![0.0; dsa.len()], vec![0.0; dsa.len()]);
            kernels::swiglu_backward(
                &b.get("shared_gate")?.data,
                &b.get("shared_up")?.data,
                &dsa,
                &mut dsg,
                &mut dsu,
            )
            .map_err(kernel_err("swiglu"))?;
            self.linear_backward(
                b,
                g,
                "ln2",
                "shared_gate_proj",
                None,
                Some("gate"),
                &dsg,
                &mut dln2,
                true,
            )?;
            self.linear_backward(
                b,
                g,
                "ln2",
                "shared_up_proj",
                None,
                Some("up"),
                &dsu,
                &mut dln2,
                true,
            )?;
        }
        if let Some(dwd) = dwd {
            g.params.insert("experts_down".into(), dwd);
            g.params.insert("experts_gate".into(), dwg);
            g.params.insert("experts_up".into(), dwu);
        }
        Ok(dln2)
    }

    fn attention_backward(
        &self,
        b: &mut Backward,
        g: &mut LayerGrads,
        dh: Vec<f32>,
    ) -> RunResult<Vec<f32>> {
        let d = &self.dims;
        let mut needed = vec![
            "attn", "q", "k", "v", "attn_lse", "ln1", "@input:x", "ln1_rstd",
        ];
        if d.qk_norm {
            needed.extend(["q_lin", "k_lin", "q_rstd", "k_rstd"]);
        }
        b.ensure(&needed)?;
        let n = d.rows();
        let mut dattn = vec![0.0; n * d.q_width()];
        self.linear_backward(
            b,
            g,
            "attn",
            "o_proj",
            None,
            Some("o"),
            &dh,
            &mut dattn,
            false,
        )?;
        let (q, k) = (b.get("q")?, b.get("k")?);
        let shape =
            ops::attention_shape(q, k, d.heads, d.kv_heads).map_err(kernel_err("attention"))?;
        let workers = kernels::attention_workers(&shape);
        let mut scratch = vec![0.0; kernels::attention_backward_scratch_len(&shape, workers)];
        let (mut dq, mut dk, mut dv) = (
            vec![0.0; shape.q_len()],
            vec![0.0; shape.kv_len()],
            vec![0.0; shape.kv_len()],
        );
        kernels::attention_backward(
            &shape,
            None,
            &q.data,
            &k.data,
            &b.get("v")?.data,
            &b.get("attn_lse")?.data,
            &dattn,
            &mut dq,
            &mut dk,
            &mut dv,
            &mut scratch,
        )
        .map_err(kernel_err("attention"))?;
        let rope = RopeTable::<f32>::new(d.seq, d.head_dim, d.theta).map_err(kernel_err("rope"))?;
        let unrotate = |grad: Vec<f32>, width: usize| -> RunResult<Vec<f32>> {
            let a = Act::new(grad, vec![d.batch, d.seq, width]);
            Ok(ops::rope(&rope, &a, d.head_dim, true)
                .map_err(kernel_err("rope"))?
                .data)
        };
        let mut dq_lin = unrotate(dq, d.q_width())?;
        let mut dk_lin = unrotate(dk, d.kv_width())?;
        if d.qk_norm {
            dq_lin = self.norm_backward(b, g, "q_lin", "q_norm", "q_rstd", &dq_lin)?;
            dk_lin = self.norm_backward(b, g, "k_lin", "k_norm", "k_rstd", &dk_lin)?;
        }
        let mut dln1 = vec![0.0; n * d.hidden];
        self.linear_backward(
            b,
            g,
            "ln1",
            "q_proj",
            Some("q_bias"),
            Some("q"),
            &dq_lin,
            &mut dln1,
            false,
        )?;
        self.linear_backward(
            b,
            g,
            "ln1",
            "k_proj",
            Some("k_bias"),
            Some("k"),
            &dk_lin,
            &mut dln1,
            true,
        )?;
        self.linear_backward(
            b,
            g,
            "ln1",
            "v_proj",
            Some("v_bias"),
            Some("v"),
            &dv,
            &mut dln1,
            true,
        )?;
        let dx_norm = self.norm_backward(b, g, "@input:x", "input_layernorm", "ln1_rstd", &dln1)?;
        Ok(dh.iter().zip(&dx_norm).map(|(a, c)| a + c).collect())
    }
}

/// The forward records of layer 0 for the given model (for `remat spec derive`).
pub fn record_block(model: &Qwen3, plan: &Plan, tokens: &[u32]) -> RunResult<Vec<Record>> {
    let d = &model.dims;
    let rope = RopeTable::<f32>::new(d.seq, d.head_dim, d.theta).map_err(kernel_err("rope"))?;
    let meter = Meter::new();
    let host = HostStore::in_memory();
    let shared = Shared {
        plan,
        config: &plan.config,
        rope: &rope,
        lora: None,
        meter: &meter,
        host: &host,
    };
    let mut x = vec![0.0; tokens.len() * d.hidden];
    kernels::embedding_forward(&model.embed.data, d.vocab, d.hidden, tokens, &mut x)
        .map_err(kernel_err("embedding"))?;
    let inputs = BTreeMap::from([("x".to_string(), Act::new(x, vec![d.batch, d.seq, d.hidden]))]);
    let mut f = Forward::new(&shared, 0, model.weights(0, false), inputs);
    model.block_forward(&mut f)?;
    Ok(f.records().to_vec())
}

impl Qwen3 {
    /// `remat spec derive`: records layer 0's forward (under `plan`, any compiled spec of
    /// this block) and writes a spec with every op output a slot rebuilt by replay.
    pub fn derive_spec(&self, plan: &Plan) -> RunResult<crate::spec::BlockSpec> {
        let d = &self.dims;
        let tokens: Vec<u32> = (0..d.rows()).map(|i| (i % d.vocab) as u32).collect();
        let records = record_block(self, plan, &tokens)?;
        let inputs = BTreeMap::from([("x".to_string(), vec![d.batch, d.seq, d.hidden])]);
        let params: BTreeMap<String, Vec<usize>> = self.layers[0]
            .iter()
            .map(|(k, v)| (k.clone(), v.shape.clone()))
            .collect();
        let shapes = crate::spec::derive::DeriveShapes {
            inputs: &inputs,
            params: &params,
        };
        let name = format!("{}-derived", self.kind.spec_name());
        let mut spec = crate::spec::derive::derive_spec(&name, &records, &shapes, "out");
        // The recorded attributes name config keys; keep the defaults they may fall back on.
        spec.config_defaults = plan.spec().config_defaults.clone();
        Ok(spec)
    }
}

/// One recomputed slot compared with the forward's value.
#[derive(Debug, Clone, PartialEq)]
pub struct RecomputeCheck {
    pub layer: usize,
    pub slot: String,
    pub bit_equal: bool,
}

impl Qwen3 {
    /// Runs the forward, then rebuilds every slot each layer's plan recomputes and compares
    /// it with the forward's value.
    pub fn verify_recompute(&self, plan: &Plan, tokens: &[u32]) -> RunResult<Vec<RecomputeCheck>> {
        let d = &self.dims;
        let rope = RopeTable::<f32>::new(d.seq, d.head_dim, d.theta).map_err(kernel_err("rope"))?;
        let (meter, host) = (Meter::new(), HostStore::in_memory());
        let lora_cfg = match plan.mode {
            Mode::Lora => self.lora.as_ref().map(|(c, _)| c),
            Mode::Full => None,
        };
        let shared = Shared {
            plan,
            config: &plan.config,
            rope: &rope,
            lora: lora_cfg,
            meter: &meter,
            host: &host,
        };
        let mut x = vec![0.0; tokens.len() * d.hidden];
        kernels::embedding_forward(&self.embed.data, d.vocab, d.hidden, tokens, &mut x)
            .map_err(kernel_err("embedding"))?;
        let mut x = Act::new(x, vec![d.batch, d.seq, d.hidden]);
        let mut checks = Vec::new();
        let mut buffers = SharedBuffers::new();
        for l in 0..d.layers {
            let mut f = Forward::new(
                &shared,
                l,
                self.weights(l, lora_cfg.is_some()),
                BTreeMap::from([("x".to_string(), x)]),
            );
            self.block_forward(&mut f)?;
            let forward_values = f.snapshot();
            let (out, state) = f.finish("out")?;
            let mut b = Backward::new(
                &shared,
                self.weights(l, lora_cfg.is_some()),
                state,
                &mut buffers,
            )?;
            for slot in b.recomputed_slots() {
                b.ensure(&[slot.as_str()])?;
                let rebuilt = b.get(&slot)?;
                let bit_equal = forward_values.get(&slot).is_some_and(|v| v.bit_eq(rebuilt));
                checks.push(RecomputeCheck {
                    layer: l,
                    slot,
                    bit_equal,
                });
            }
            x = out;
        }
        Ok(checks)
    }
}
