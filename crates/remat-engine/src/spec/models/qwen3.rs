//! Qwen3-style dense and MoE decoder models whose blocks run through a compiled recompute
//! spec: the forward records every op into the layer's slots, the plan decides what each
//! layer keeps, offloads or drops, and backward rebuilds what it needs through the layer's
//! plan (see [`crate::spec::run::exec`]).
//!
//! Full fine-tuning trains every weight; LoRA mode trains only adapters on the attention
//! and MLP projections (routed experts carry none), with the base weights and norms frozen.

mod backward;
mod dims;
mod forward;
pub mod hf;
mod inspect;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::core::kernels::RopeTable;
use crate::spec::ModelConfig;
use crate::spec::compile::{Mode, Plan};
use crate::spec::run::Act;
use crate::spec::run::exec::{Backward, Forward, LayerWeights, Scratch};
use crate::spec::run::lora::{LayerAdapters, LoraConfig};
use crate::spec::run::meter::{Hold, Meter};
use crate::spec::run::{RunError, RunResult};

use super::grads::{LayerGrads, SpecGrads};
use super::head::{LmHead, embed_tokens};
use super::init::{filled, uniform};
use super::lora::{check_lora, init_adapters, trainable_values};
use super::step::{
    BlockRunner, StackDims, StepEnv, StepStats, UniformModel, check_stacked_plan, run_uniform_step,
};
pub use dims::{CONFIG_KEYS, Qwen3Dims};
pub use inspect::{RecomputeCheck, record_block};

/// The gradients of a Qwen3 step ([`SpecGrads`]: embedding, norm, head, each layer's
/// parameters by spec name, adapters).
pub type Qwen3Grads = SpecGrads;

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
