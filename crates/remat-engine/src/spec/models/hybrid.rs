//! Hybrid models: a block type per layer (Jamba-style Mamba layers with attention layers,
//! or Qwen3 and Qwen3-MoE interleaved), each layer run through the plan compiled from its
//! own block's spec. Recompute buffers are shared only among layers of one block type
//! (one [`SharedBuffers`](crate::spec::run::exec::SharedBuffers) per type: the same shapes), never across types.
//!
//! The config lists the types in `layer_types` (`"mamba mamba mamba qwen3"`, spaces or
//! commas); top-level keys are common to every block (`hidden_size`, `batch`, `seq_len`,
//! `vocab_size`, `rms_norm_eps` for the final norm) and a table named after a block type
//! (`[mamba]`, `[qwen3]`, `[qwen3-moe]`) holds that block's own keys, overriding common
//! ones: `intermediate_size` is the MLP width under `[qwen3]` and the scan width under
//! `[mamba]`.

use std::collections::BTreeMap;

use crate::spec::compile::{Mode, Plan};
use crate::spec::run::Act;
use crate::spec::run::exec::{Backward, Forward, Scratch, Shared};
use crate::spec::run::lora::{LayerAdapters, LoraConfig};
use crate::spec::run::{RunError, RunResult, check};
use crate::spec::{ModelConfig, Value};

use super::grads::{LayerGrads, SpecGrads};
use super::head::LmHead;
use super::init::{filled, uniform};
use super::lora::{check_lora, init_adapters, trainable_values};
use super::mamba::{self, Mamba};
use super::qwen3::{BlockKind, Qwen3};
use super::step::{
    BlockRunner, StepEnv, StepModel, StepStats, check_layer_plan, mode_lora, run_step,
};
use crate::core::kernels::RopeTable;

/// The gradients of a hybrid step ([`SpecGrads`]: embedding, norm, head, each layer's
/// parameters by spec name, adapters), whichever block each layer runs.
pub type HybridGrads = SpecGrads;

/// The block types a hybrid layer may name.
pub const BLOCK_TYPES: &[&str] = &["qwen3", "qwen3-moe", "mamba"];

/// One block type of the model: what runs its layers' forward and backward.
#[derive(Debug, Clone)]
pub enum BlockModel {
    Qwen3(Qwen3),
    Mamba(Mamba),
}

/// A block type with its own config (common keys + its table, `num_hidden_layers` = all
/// layers of the model, so its plan has one layer plan per model layer).
#[derive(Debug, Clone)]
pub struct HybridBlock {
    pub name: String,
    pub config: ModelConfig,
    pub model: BlockModel,
}

/// A model whose layers are of several block types.
#[derive(Debug, Clone)]
pub struct Hybrid {
    pub config: ModelConfig,
    pub blocks: Vec<HybridBlock>,
    /// Index into `blocks` of each layer.
    pub layer_block: Vec<usize>,
    pub embed: Act,
    pub final_norm: Act,
    pub lm_head: Act,
    pub layers: Vec<BTreeMap<String, Act>>,
    pub lora: Option<(LoraConfig, Vec<LayerAdapters>)>,
    eps: f64,
    batch: usize,
    seq: usize,
}

/// The layer types `layer_types` lists, or an error naming the field and the entry.
pub fn layer_types(cfg: &ModelConfig) -> RunResult<Vec<String>> {
    let bad =
        |reason: String| RunError::Model(format!("config {}: `layer_types`: {reason}", cfg.source));
    let text = match cfg.get("layer_types") {
        Some(Value::Str(s)) => s.clone(),
        Some(other) => return Err(bad(format!("{other} is not a string of block names"))),
        None => {
            return Err(bad(
                "is not set (a block name per layer, e.g. \"mamba mamba mamba qwen3\")".into(),
            ));
        }
    };
    let types: Vec<String> = text
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    if types.is_empty() {
        return Err(bad("lists no layer".into()));
    }
    if let Some((i, t)) = types
        .iter()
        .enumerate()
        .find(|(_, t)| !BLOCK_TYPES.contains(&t.as_str()))
    {
        return Err(bad(format!(
            "layer {i} names `{t}`, which is not a known block spec ({})",
            BLOCK_TYPES.join(", ")
        )));
    }
    Ok(types)
}

/// The config block `name` compiles against: common keys, then its own table's, with
/// `num_hidden_layers` = `layers`.
pub fn block_config(cfg: &ModelConfig, name: &str, layers: usize) -> ModelConfig {
    let mut out = ModelConfig::new(format!("{} [{name}]", cfg.source));
    let prefix = format!("{name}.");
    for (k, v) in &cfg.values {
        if !k.contains('.') {
            out.values.insert(k.clone(), v.clone());
        }
    }
    for (k, v) in &cfg.values {
        if let Some(own) = k.strip_prefix(&prefix) {
            out.values.insert(own.to_string(), v.clone());
        }
    }
    out.values.remove("layer_types");
    out.set("num_hidden_layers", Value::Int(layers as i64))
}

impl BlockModel {
    /// Builds one layer's parameters (its own seed) and the block model for its sizes.
    fn build(name: &str, cfg: &ModelConfig, seed: u64) -> RunResult<(Self, BTreeMap<String, Act>)> {
        let one = cfg.clone().set("num_hidden_layers", Value::Int(1));
        Ok(match name {
            "mamba" => {
                let mut m = Mamba::new(&one, seed)?;
                let params = m.layers.pop().unwrap_or_default();
                (BlockModel::Mamba(m), params)
            }
            other => {
                let kind = BlockKind::from_name(other)
                    .ok_or_else(|| RunError::Model(format!("unknown block type `{other}`")))?;
                let mut m = Qwen3::new(kind, &one, seed)?;
                let params = m.layers.pop().unwrap_or_default();
                (BlockModel::Qwen3(m), params)
            }
        })
    }

    fn hidden(&self) -> usize {
        match self {
            BlockModel::Qwen3(m) => m.dims.hidden,
            BlockModel::Mamba(m) => m.dims.hidden,
        }
    }

    fn backward_reads(&self) -> Vec<&'static str> {
        match self {
            BlockModel::Qwen3(m) => m.backward_reads(),
            BlockModel::Mamba(_) => mamba::BACKWARD_READS.to_vec(),
        }
    }

    fn forward(&self, f: &mut Forward) -> RunResult<()> {
        match self {
            BlockModel::Qwen3(m) => m.block_forward(f),
            BlockModel::Mamba(m) => m.block_forward(f),
        }
    }

    fn backward(
        &self,
        b: &mut Backward,
        dout: crate::spec::run::exec::Scratch,
        g: &mut LayerGrads,
    ) -> RunResult<crate::spec::run::exec::Scratch> {
        match self {
            BlockModel::Qwen3(m) => m.block_backward(b, dout, g),
            BlockModel::Mamba(m) => m.block_backward(b, dout, g),
        }
    }

    /// The RoPE table of an attention block.
    fn rope(&self) -> RunResult<Option<RopeTable<f32>>> {
        match self {
            BlockModel::Qwen3(m) => {
                RopeTable::<f32>::new(m.dims.seq, m.dims.head_dim, m.dims.theta)
                    .map(Some)
                    .map_err(|e| RunError::Model(e.to_string()))
            }
            BlockModel::Mamba(_) => Ok(None),
        }
    }
}

/// The base weight a LoRA target adapts in a layer's parameters.
fn lora_weight<'a>(params: &'a BTreeMap<String, Act>, target: &str) -> Option<&'a Act> {
    let name = match target {
        "in" | "x" | "out" => format!("{target}_proj"),
        "gate" | "up" | "down" if params.contains_key("router") => format!("shared_{target}_proj"),
        t => format!("{t}_proj"),
    };
    params.get(&name)
}

impl Hybrid {
    /// A random model of `config` (`vocab_size`, `batch`, `seq_len` set).
    pub fn new(config: &ModelConfig, seed: u64) -> RunResult<Self> {
        let types = layer_types(config)?;
        let n = types.len();
        let mut names: Vec<String> = Vec::new();
        let mut blocks: Vec<HybridBlock> = Vec::new();
        let mut layer_block = Vec::with_capacity(n);
        let mut layers = Vec::with_capacity(n);
        for (l, t) in types.iter().enumerate() {
            let cfg = block_config(config, t, n);
            let (model, params) = BlockModel::build(t, &cfg, seed ^ ((l as u64 + 1) << 32))?;
            let index = match names.iter().position(|x| x == t) {
                Some(i) => i,
                None => {
                    names.push(t.clone());
                    blocks.push(HybridBlock {
                        name: t.clone(),
                        config: cfg,
                        model,
                    });
                    names.len() - 1
                }
            };
            layer_block.push(index);
            layers.push(params);
        }
        let hidden = config.usize_of("hidden_size", "hybrid model")?;
        if let Some(b) = blocks.iter().find(|b| b.model.hidden() != hidden) {
            return Err(RunError::Model(format!(
                "config {}: `{}.hidden_size` = {} but `hidden_size` = {hidden}: every layer passes the same residual stream",
                config.source,
                b.name,
                b.model.hidden()
            )));
        }
        let vocab = config.usize_of("vocab_size", "hybrid model")?;
        let eps = match config.get("rms_norm_eps") {
            Some(Value::Float(x)) if x.is_finite() && *x > 0.0 => *x,
            None => 1e-6,
            Some(other) => {
                return Err(RunError::Model(format!(
                    "config {}: `rms_norm_eps` = {other}: must be a finite number greater than 0",
                    config.source
                )));
            }
        };
        let embed = Act::new(uniform(seed, 1, vocab * hidden, 1.0)?, vec![vocab, hidden]);
        let lm_head = Act::new(
            uniform(seed, 2, vocab * hidden, 1.0 / (hidden as f32).sqrt())?,
            vec![vocab, hidden],
        );
        Ok(Self {
            config: config.clone(),
            blocks,
            layer_block,
            embed,
            final_norm: Act::new(filled(hidden, |_| 1.0)?, vec![hidden]),
            lm_head,
            layers,
            lora: None,
            eps,
            batch: config.usize_of("batch", "hybrid model")?,
            seq: config.usize_of("seq_len", "hybrid model")?,
        })
    }

    /// Adds LoRA adapters on every target of `cfg` that a layer's block has.
    pub fn with_lora(mut self, cfg: LoraConfig, random_b: bool) -> RunResult<Self> {
        check_lora(&cfg)?;
        let layers = &self.layers;
        let adapters = init_adapters(&cfg, random_b, layers.len(), |l, t| {
            lora_weight(&layers[l], t).map(|w| (w.shape[0], w.shape[1]))
        })?;
        self.lora = Some((cfg, adapters));
        Ok(self)
    }

    /// Trainable values in `mode`.
    pub fn trainable(&self, mode: Mode) -> usize {
        let adapters = self.lora.as_ref().map(|(_, a)| a.as_slice());
        let whole = [&self.embed, &self.final_norm, &self.lm_head];
        trainable_values(mode, adapters, &whole, &self.layers)
    }

    /// Checks `plans` (one per block type, in `blocks` order): each compiled from its
    /// block's spec for every layer, with the parameter shapes and backward reads of the
    /// layers of its type.
    pub fn check_plans(&self, plans: &[Plan]) -> RunResult<()> {
        let bad = |what: String| Err(RunError::Model(what));
        if plans.len() != self.blocks.len() {
            return bad(format!(
                "{} plans for {} block types",
                plans.len(),
                self.blocks.len()
            ));
        }
        for (block, plan) in self.blocks.iter().zip(plans) {
            let name = &plan.spec().name;
            let base = ["-derived", "-save-all"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(name);
            if base != block.name {
                return bad(format!(
                    "the plan for the `{}` layers is for block `{name}`",
                    block.name
                ));
            }
            if plan.layers.len() != self.layers.len() {
                return bad(format!(
                    "plan `{name}` has {} layers, the model {}",
                    plan.layers.len(),
                    self.layers.len()
                ));
            }
            check::check_dtypes(plan)?;
            if plans.iter().any(|p| p.mode != plan.mode) {
                return bad("the block plans are compiled for different modes".into());
            }
        }
        for (l, params) in self.layers.iter().enumerate() {
            let block = &self.blocks[self.layer_block[l]];
            let plan = &plans[self.layer_block[l]];
            check_layer_plan(
                &format!("layer {l} ({})", block.name),
                plan,
                &plan.layers[l],
                params,
                &block.model.backward_reads(),
            )?;
        }
        Ok(())
    }

    /// Device bytes the plans keep per layer (each layer under its own type's plan), the
    /// host bytes, and the shared recompute buffers: one set per type, live only during a
    /// layer's backward, so the largest type's set: what the meter must measure.
    pub fn predicted(&self, plans: &[Plan]) -> (u64, u64, u64) {
        let (mut saved, mut host) = (0u64, 0u64);
        for (l, &b) in self.layer_block.iter().enumerate() {
            saved += plans[b].layers[l].bytes.saved;
            host += plans[b].layers[l].bytes.offloaded;
        }
        let shared = plans
            .iter()
            .map(Plan::shared_buffer_bytes)
            .max()
            .unwrap_or(0);
        (saved, shared, host)
    }

    /// One forward and backward: each layer under its type's plan.
    pub fn step(
        &self,
        plans: &[Plan],
        tokens: &[u32],
        targets: &[u32],
        env: StepEnv,
    ) -> RunResult<(HybridGrads, StepStats)> {
        self.check_plans(plans)?;
        let rows = self.batch * self.seq;
        if tokens.len() != rows || targets.len() != rows {
            return Err(RunError::Model(format!(
                "expected {rows} tokens and targets (batch {} x seq {}), got {} and {}",
                self.batch,
                self.seq,
                tokens.len(),
                targets.len()
            )));
        }
        let mode = plans.first().map_or(Mode::Full, |p| p.mode);
        let lora_cfg = mode_lora(mode, self.lora.as_ref())?;
        let ropes = self
            .blocks
            .iter()
            .map(|b| b.model.rope())
            .collect::<RunResult<Vec<_>>>()?;
        let meter = env.meter;
        let shared: Vec<Shared> = plans
            .iter()
            .zip(&ropes)
            .map(|(plan, rope)| Shared {
                plan,
                config: &plan.config,
                rope: rope.as_ref(),
                lora: lora_cfg,
                meter,
                host: env.host,
                step: env.step,
            })
            .collect();
        let model = StepModel {
            embed: &self.embed,
            head: LmHead {
                final_norm: &self.final_norm,
                lm_head: &self.lm_head,
                eps: self.eps,
            },
            batch: self.batch,
            seq: self.seq,
            layers: &self.layers,
            adapters: self.lora.as_ref().map(|(_, a)| a.as_slice()),
            layer_block: &self.layer_block,
        };
        run_step(model, &shared, self, mode, tokens, targets, env)
    }
}

impl BlockRunner for Hybrid {
    fn forward(&self, layer: usize, f: &mut Forward) -> RunResult<()> {
        self.blocks[self.layer_block[layer]].model.forward(f)
    }

    fn backward(
        &self,
        layer: usize,
        b: &mut Backward,
        dout: Scratch,
        g: &mut LayerGrads,
    ) -> RunResult<Scratch> {
        self.blocks[self.layer_block[layer]]
            .model
            .backward(b, dout, g)
    }
}
