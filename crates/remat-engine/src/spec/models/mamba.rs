//! A Mamba-1 language model (Hugging Face `MambaForCausalLM`'s layout) whose blocks run
//! through a compiled recompute spec (`specs/mamba.toml`): the forward records every op into
//! the layer's slots, the plan decides what each layer keeps, offloads or drops, and
//! backward rebuilds what it reads through the generic runtime
//! ([`crate::spec::run::exec`]); nothing here knows which slots are recomputed.
//!
//! Full fine-tuning trains every weight; LoRA mode trains only adapters on in_proj, x_proj
//! and out_proj (targets `in`, `x`, `out`).

mod backward;
mod forward;
pub mod hf;
mod inspect;

use std::collections::BTreeMap;

use crate::spec::compile::{Mode, Plan};
use crate::spec::run::Act;
use crate::spec::run::exec::{Backward, Forward, LayerWeights, Scratch};
use crate::spec::run::lora::{LayerAdapters, LoraConfig};
use crate::spec::run::{RunError, RunResult};
use crate::spec::{ModelConfig, Value};

use super::grads::{LayerGrads, SpecGrads};
use super::head::LmHead;
use super::init::{filled, uniform};
use super::lora::{check_lora, init_adapters, trainable_values};
use super::step::{
    BlockRunner, StackDims, StepEnv, StepStats, UniformModel, check_stacked_plan, run_uniform_step,
};

/// The gradients of a Mamba step ([`SpecGrads`]: embedding, norm, head, each layer's
/// parameters by spec name, adapters).
pub type MambaGrads = SpecGrads;

/// The spec name of the block.
pub const BLOCK: &str = "mamba";

/// Every model-config key the Mamba model reads (Hugging Face `MambaConfig` names, the
/// original `mamba_ssm` names `d_state` / `d_conv` as cross-checks, plus `batch`,
/// `seq_len` and `scan_chunk`, which describe the run).
pub const CONFIG_KEYS: &[&str] = &[
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "expand",
    "state_size",
    "d_state",
    "conv_kernel",
    "d_conv",
    "time_step_rank",
    "num_hidden_layers",
    "num_layers",
    "layer_norm_epsilon",
    "use_bias",
    "use_conv_bias",
    "scan_chunk",
    "batch",
    "seq_len",
];

/// LoRA targets the Mamba block has.
pub const LORA_TARGETS: &[&str] = &["in", "x", "out"];

/// Sizes and switches read from the model config.
#[derive(Debug, Clone, PartialEq)]
pub struct MambaDims {
    pub vocab: usize,
    pub hidden: usize,
    /// `intermediate_size` (Di): channels of the scan.
    pub inner: usize,
    /// `state_size` (N).
    pub state: usize,
    /// `conv_kernel` (K).
    pub conv: usize,
    /// `time_step_rank` (R).
    pub dt_rank: usize,
    pub layers: usize,
    pub eps: f64,
    pub bias: bool,
    pub conv_bias: bool,
    pub chunk: usize,
    pub batch: usize,
    pub seq: usize,
}

fn bad_config(cfg: &ModelConfig, reason: String) -> RunError {
    RunError::Model(format!("config {}: {reason}", cfg.source))
}

fn flag(cfg: &ModelConfig, key: &str, default: bool) -> RunResult<bool> {
    match cfg.get(key) {
        None => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(bad_config(cfg, format!("`{key}` = {other} is not a bool"))),
    }
}

/// An optional integer key; a present value must be a non-negative integer.
fn opt_usize(cfg: &ModelConfig, key: &str) -> RunResult<Option<usize>> {
    match cfg.get(key) {
        None => Ok(None),
        Some(_) => Ok(Some(cfg.usize_of(key, "mamba model")?)),
    }
}

impl MambaDims {
    pub fn from_config(cfg: &ModelConfig) -> RunResult<Self> {
        let n = |k: &str| cfg.usize_of(k, "mamba model").map_err(RunError::from);
        if let Some(Value::Str(s)) = cfg.get("time_step_rank") {
            return Err(bad_config(
                cfg,
                format!(
                    "`time_step_rank` = {s:?}: give the rank as an integer (Hugging Face's \"auto\" is ceil(hidden_size / 16))"
                ),
            ));
        }
        let eps = match cfg.get("layer_norm_epsilon") {
            None => 1e-5,
            Some(Value::Float(x)) => *x,
            Some(Value::Int(i)) => *i as f64,
            Some(other) => {
                return Err(bad_config(
                    cfg,
                    format!("`layer_norm_epsilon` = {other} is not a number"),
                ));
            }
        };
        let dims = Self {
            vocab: n("vocab_size")?,
            hidden: n("hidden_size")?,
            inner: n("intermediate_size")?,
            state: n("state_size")?,
            conv: n("conv_kernel")?,
            dt_rank: n("time_step_rank")?,
            layers: cfg.num_layers()?,
            eps,
            bias: flag(cfg, "use_bias", false)?,
            conv_bias: flag(cfg, "use_conv_bias", true)?,
            chunk: n("scan_chunk")?,
            batch: n("batch")?,
            seq: n("seq_len")?,
        };
        dims.check(cfg)?;
        Ok(dims)
    }

    /// Every size must be positive, the epsilon finite and positive, and the sizes that
    /// the config states twice must agree: `intermediate_size = expand * hidden_size`, and
    /// `d_state` / `d_conv` (mamba_ssm's names), when present, equal to `state_size` /
    /// `conv_kernel`.
    fn check(&self, cfg: &ModelConfig) -> RunResult<()> {
        let sizes = [
            ("num_hidden_layers", self.layers),
            ("vocab_size", self.vocab),
            ("batch", self.batch),
            ("seq_len", self.seq),
            ("hidden_size", self.hidden),
            ("intermediate_size", self.inner),
            ("state_size", self.state),
            ("conv_kernel", self.conv),
            ("time_step_rank", self.dt_rank),
            ("scan_chunk", self.chunk),
        ];
        if let Some((key, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return Err(bad_config(
                cfg,
                format!("`{key}` = 0: every Mamba dimension must be at least 1"),
            ));
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(bad_config(
                cfg,
                format!(
                    "`layer_norm_epsilon` = {}: must be a finite number greater than 0",
                    self.eps
                ),
            ));
        }
        if let Some(expand) = opt_usize(cfg, "expand")?
            && expand.checked_mul(self.hidden) != Some(self.inner)
        {
            return Err(bad_config(
                cfg,
                format!(
                    "`intermediate_size` = {} but `expand` x `hidden_size` = {expand} x {} (Mamba's inner width is expand x hidden)",
                    self.inner, self.hidden
                ),
            ));
        }
        for (alias, key, value) in [
            ("d_state", "state_size", self.state),
            ("d_conv", "conv_kernel", self.conv),
        ] {
            if let Some(other) = opt_usize(cfg, alias)?
                && other != value
            {
                return Err(bad_config(
                    cfg,
                    format!(
                        "`{alias}` = {other} but `{key}` = {value}: the two name the same size"
                    ),
                ));
            }
        }
        Ok(())
    }

    fn rows(&self) -> usize {
        self.batch * self.seq
    }

    /// Parameter shapes of one layer under the spec's `@param:` names.
    pub fn layer_shapes(&self) -> Vec<(&'static str, Vec<usize>)> {
        let (d, di, n, r) = (self.hidden, self.inner, self.state, self.dt_rank);
        let mut shapes = vec![
            ("norm", vec![d]),
            ("in_proj", vec![2 * di, d]),
            ("conv1d_weight", vec![di, 1, self.conv]),
            ("x_proj", vec![r + 2 * n, di]),
            ("dt_proj", vec![di, r]),
            ("dt_proj_bias", vec![di]),
            ("A_log", vec![di, n]),
            ("D", vec![di]),
            ("out_proj", vec![d, di]),
        ];
        if self.conv_bias {
            shapes.push(("conv1d_bias", vec![di]));
        }
        if self.bias {
            shapes.push(("in_proj_bias", vec![2 * di]));
            shapes.push(("out_proj_bias", vec![d]));
        }
        shapes
    }

    /// `[out, in]` of the weight a LoRA target adapts.
    fn lora_dims(&self, target: &str) -> Option<(usize, usize)> {
        let (d, di) = (self.hidden, self.inner);
        match target {
            "in" => Some((2 * di, d)),
            "x" => Some((self.dt_rank + 2 * self.state, di)),
            "out" => Some((d, di)),
            _ => None,
        }
    }

    /// f32 values the parameters hold (with adapters of `(rank, targets)`), or an error when
    /// the count overflows.
    pub fn param_count(&self, lora: Option<(usize, &[String])>) -> RunResult<u64> {
        let count = || -> Option<u64> {
            let mul = |a: &[usize]| a.iter().try_fold(1u64, |acc, &v| acc.checked_mul(v as u64));
            let mut per_layer = 0u64;
            for (_, shape) in self.layer_shapes() {
                per_layer = per_layer.checked_add(mul(&shape)?)?;
            }
            for t in lora.map_or(&[][..], |(_, t)| t) {
                if let (Some((out, inp)), Some((rank, _))) = (self.lora_dims(t), lora) {
                    per_layer = per_layer.checked_add(mul(&[rank, out.checked_add(inp)?])?)?;
                }
            }
            mul(&[2, self.vocab, self.hidden])?
                .checked_add(self.hidden as u64)?
                .checked_add(per_layer.checked_mul(self.layers as u64)?)
        };
        count().ok_or_else(|| {
            RunError::Model(format!(
                "the Mamba model's parameters overflow a 64-bit count (hidden {}, inner {}, {} layers)",
                self.hidden, self.inner, self.layers
            ))
        })
    }
}

/// A Mamba-1 model: token embedding, blocks, final RMSNorm (`norm_f`), LM head.
#[derive(Debug, Clone)]
pub struct Mamba {
    pub dims: MambaDims,
    pub config: ModelConfig,
    pub embed: Act,
    pub final_norm: Act,
    pub lm_head: Act,
    /// Per layer, parameters under the spec's `@param:` names.
    pub layers: Vec<BTreeMap<String, Act>>,
    pub lora: Option<(LoraConfig, Vec<LayerAdapters>)>,
}

/// Slots the Mamba backward reads (besides the block input `x`).
pub(crate) const BACKWARD_READS: [&str; 11] = [
    "gated",
    "y",
    "xz",
    "scan_states",
    "u",
    "dt",
    "dt_raw",
    "x_dbc",
    "conv",
    "ln",
    "ln_rstd",
];

impl Mamba {
    /// A randomly initialised model (`seed`) in the spirit of `MambaMixer`'s init:
    /// `A_log[d, n] = ln(n + 1)`, `D = 1`, dt_proj's bias the inverse softplus of step sizes
    /// spread log-uniformly over [0.001, 0.1], other weights uniform in +-1/sqrt(fan in).
    pub fn new(config: &ModelConfig, seed: u64) -> RunResult<Self> {
        let dims = MambaDims::from_config(config)?;
        dims.param_count(None)?;
        let d = &dims;
        let mut stream = 0u64;
        let mut param = |shape: &[usize], fan_in: usize| -> RunResult<Act> {
            stream += 1;
            let n = shape.iter().product();
            Ok(Act::new(
                uniform(seed, stream, n, 1.0 / (fan_in as f32).sqrt())?,
                shape.to_vec(),
            ))
        };
        let embed = param(&[d.vocab, d.hidden], 1)?;
        let lm_head = param(&[d.vocab, d.hidden], d.hidden)?;
        let mut layers = Vec::with_capacity(d.layers);
        for _ in 0..d.layers {
            let mut p = BTreeMap::new();
            for (name, shape) in d.layer_shapes() {
                let value = match name {
                    "norm" => Act::new(filled(d.hidden, |_| 1.0)?, shape),
                    "A_log" => {
                        let n = d.state;
                        Act::new(filled(d.inner * n, |i| ((i % n) as f32 + 1.0).ln())?, shape)
                    }
                    "D" => Act::new(filled(d.inner, |_| 1.0)?, shape),
                    "dt_proj_bias" => {
                        let spread = param(&shape, 1)?;
                        let (lo, hi) = (0.001f32.ln(), 0.1f32.ln());
                        let data = spread
                            .data
                            .iter()
                            .map(|v| {
                                let dt = (lo + (v + 1.0) * 0.5 * (hi - lo)).exp();
                                // softplus^-1(dt) = dt + ln(1 - e^-dt)
                                dt + (-(-dt).exp_m1()).ln()
                            })
                            .collect();
                        Act::new(data, shape)
                    }
                    "conv1d_weight" | "conv1d_bias" => param(&shape, d.conv)?,
                    _ => {
                        let fan_in = if shape.len() == 2 { shape[1] } else { 16 };
                        param(&shape, fan_in)?
                    }
                };
                p.insert(name.to_string(), value);
            }
            layers.push(p);
        }
        let final_norm = Act::new(filled(d.hidden, |_| 1.0)?, vec![d.hidden]);
        Ok(Self {
            dims,
            config: config.clone(),
            embed,
            final_norm,
            lm_head,
            layers,
            lora: None,
        })
    }

    /// Adds LoRA adapters on the targets of `cfg` that a Mamba block has (`in`, `x`,
    /// `out`); `B` starts at zero unless `random_b`.
    pub fn with_lora(mut self, cfg: LoraConfig, random_b: bool) -> RunResult<Self> {
        check_lora(&cfg)?;
        if let Some(t) = cfg
            .targets
            .iter()
            .find(|t| !LORA_TARGETS.contains(&t.as_str()))
        {
            return Err(RunError::Model(format!(
                "LoRA target `{t}` is not one of the Mamba block's (in, x, out)"
            )));
        }
        self.dims.param_count(Some((cfg.rank, &cfg.targets)))?;
        let dims = &self.dims;
        let adapters = init_adapters(&cfg, random_b, self.layers.len(), |_, t| dims.lora_dims(t))?;
        self.lora = Some((cfg, adapters));
        Ok(self)
    }

    /// Trainable values in `mode`.
    pub fn trainable(&self, mode: Mode) -> usize {
        let adapters = self.lora.as_ref().map(|(_, a)| a.as_slice());
        let whole = [&self.embed, &self.final_norm, &self.lm_head];
        trainable_values(mode, adapters, &whole, &self.layers)
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

    /// Checks that `plan` was compiled from a Mamba spec for this model: its name, block
    /// output, layer count, dtypes, parameter shapes and the slots backward reads.
    pub fn check_plan(&self, plan: &Plan) -> RunResult<()> {
        let d = &self.dims;
        let bad = |what: String| Err(RunError::Model(what));
        let name = &plan.spec().name;
        let base = ["-derived", "-save-all"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        if base != BLOCK {
            return bad(format!(
                "plan is for block `{name}`, the model stacks `mamba`"
            ));
        }
        let dims = StackDims {
            layers: d.layers,
            batch: d.batch,
            seq: d.seq,
            hidden: d.hidden,
        };
        check_stacked_plan(plan, BLOCK, &dims, &self.layers, &BACKWARD_READS)
    }

    /// One forward and backward under `plan`: loss, gradients and memory figures. Every
    /// buffer is charged to `env.meter`'s pool.
    pub fn step(
        &self,
        plan: &Plan,
        tokens: &[u32],
        targets: &[u32],
        env: StepEnv,
    ) -> RunResult<(MambaGrads, StepStats)> {
        let d = &self.dims;
        self.check_plan(plan)?;
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
            rope: None,
        };
        run_uniform_step(model, plan, self, tokens, targets, env)
    }
}

impl BlockRunner for Mamba {
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
