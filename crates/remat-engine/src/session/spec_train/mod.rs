//! Training a spec-driven model (`remat train --block qwen3|qwen3-moe|mamba|hybrid [--spec
//! FILE] [--mode full|lora]`): a Qwen3-style, Mamba or hybrid model whose blocks run through
//! a compiled recompute spec, on a [`Task`]. Every buffer (parameters, optimizer state,
//! gradients, activations, scratch) is charged to one memory pool, so a memory budget
//! applies and the reported peak is measured.
//!
//! - [`run`]: the whole flow for a [`SpecTrainSetup`]: the block resolved ([`block`]), the
//!   spec compiled against its config (one plan, or one per block type of a hybrid), the
//!   model built within the budget, optionally the per-layer mix of keep, recompute and
//!   offload chosen for the budget ([`crate::session::spec_mix`]), then the steps under
//!   [`AdamW`] ([`optim`]). What a front end prints arrives as [`Progress`] while it runs
//!   and as the [`SpecTrainSummary`] it returns.
//!
//! Errors are [`SessionError`]s naming the flag, file, spec or tensor at fault.

pub mod block;
pub mod optim;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

pub use block::{Block, check_block_sets, load_spec_and_config, resolve_block};
pub use optim::AdamW;

use crate::core::context::ExecContext;
use crate::core::pool::{Category, MemoryPool, Reservation};
use crate::core::swap::HostStore;
use crate::models::hf_file::check_target;
use crate::session::error::{Chain, During, Result, SessionError};
use crate::session::spec_mix::{TUNE_ROUNDS, choose, mix_model, profile};
use crate::session::task::Task;
use crate::spec::mix::{MixModel, Profile, Tuned};
use crate::spec::models::hybrid::{self, Hybrid};
use crate::spec::models::mamba::{self, Mamba, MambaDims};
use crate::spec::models::qwen3::{self, Qwen3, Qwen3Dims};
use crate::spec::models::{SpecGrads, StepEnv, StepStats};
use crate::spec::run::Act;
use crate::spec::run::check;
use crate::spec::run::lora::{LayerAdapters, LoraConfig};
use crate::spec::run::meter::Meter;
use crate::spec::shipped::{HYBRID_CONFIG_FILE, HYBRID_CONFIG_TEXT, ShippedBlock};
use crate::spec::{BlockSpec, Mode, ModelConfig, Plan, Value, compile};

/// What a spec-driven training run is asked to do (the `remat train` flags it reads).
#[derive(Debug, Clone)]
pub struct SpecTrainSetup<'a> {
    /// `--spec FILE`: the spec to run (it names its block).
    pub spec: Option<&'a Path>,
    /// `--block NAME` (`qwen3` when neither it nor `spec` is given).
    pub block: Option<&'a str>,
    /// `--block-config FILE`: the model config (the shipped block's when absent).
    pub block_config: Option<&'a Path>,
    /// `--block-set KEY=VALUE`s applied to the config.
    pub block_set: &'a [String],
    pub mode: Mode,
    pub lora_rank: usize,
    pub lora_alpha: f32,
    pub lora_dropout: f64,
    pub seed: u64,
    pub batch: usize,
    pub lr: f32,
    pub steps: u64,
    pub threads: usize,
    /// `--memory-budget`: the pool's budget (unbounded when absent).
    pub memory_budget: Option<u64>,
    /// `--policy auto` with this budget: the per-layer mix is chosen to fit it.
    pub auto_budget: Option<u64>,
    /// `--init FILE`: Hugging Face parameters to start from.
    pub init: Option<&'a Path>,
    /// `--dump-grads FILE`: where the first step's gradients are written.
    pub dump_grads: Option<&'a Path>,
}

/// The model about to be trained.
#[derive(Debug, Clone)]
pub struct Started<'a> {
    pub block: &'static str,
    /// How the spec is named: its file, or the block's name.
    pub spec_source: &'a str,
    pub mode: Mode,
    pub layers: usize,
    pub hidden: usize,
    pub trainable: usize,
}

/// What happens while a run goes, in order, for a front end to print.
pub enum Progress<'a> {
    /// Parameters were loaded from this file (`--init`).
    Loaded(&'a Path),
    /// The model is about to be profiled for the per-layer mix (`--policy auto`).
    Profiling,
    /// The mix chosen for the budget: the run-off between candidates (`tuned`) and the
    /// mix model and profile it was chosen on; `base` bytes were taken before the step.
    Mixed {
        model: &'a MixModel,
        profile: &'a Profile,
        tuned: &'a Tuned,
        base: u64,
    },
    /// The model is built and the steps begin.
    Started(&'a Started<'a>),
    /// The first step's gradients, batch and loss were written to this file.
    DumpedGrads(&'a Path),
    /// A step finished with this loss.
    Step { step: u64, loss: f32 },
}

/// What a run measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpecTrainSummary {
    /// The first step's loss (none when no step ran).
    pub first_loss: Option<f32>,
    pub last_loss: f32,
    /// The pool's peak: parameters, optimizer state, gradients, every activation and
    /// scratch buffer of the step.
    pub pool_peak: u64,
    /// The most bytes of saved slots, all layers together.
    pub saved_peak: u64,
    /// The most bytes of shared recompute buffers.
    pub shared_peak: u64,
    pub host_peak: u64,
    /// Wall time of the steps.
    pub seconds: f64,
}

/// A spec-driven model being trained.
enum Trainee {
    Qwen3(Qwen3),
    Mamba(Mamba),
    Hybrid(Hybrid),
}

/// The trainable buffers of a [`Trainee`], for the optimizer.
struct Parts<'a> {
    embed: &'a mut Act,
    final_norm: &'a mut Act,
    lm_head: &'a mut Act,
    layers: &'a mut [BTreeMap<String, Act>],
    adapters: Option<&'a mut Vec<LayerAdapters>>,
}

fn one(plans: &[Plan]) -> Result<&Plan> {
    plans
        .first()
        .ok_or_else(|| SessionError::invalid("no plan"))
}

impl Trainee {
    /// One step under `plans`: one plan, or one per block type of a hybrid.
    fn step(
        &self,
        plans: &[Plan],
        tokens: &[u32],
        targets: &[u32],
        env: StepEnv,
    ) -> Result<(SpecGrads, StepStats)> {
        Ok(match self {
            Trainee::Qwen3(m) => m.step(one(plans)?, tokens, targets, env)?,
            Trainee::Mamba(m) => m.step(one(plans)?, tokens, targets, env)?,
            Trainee::Hybrid(m) => m.step(plans, tokens, targets, env)?,
        })
    }

    fn check_plans(&self, plans: &[Plan]) -> Result<()> {
        match self {
            Trainee::Qwen3(m) => m.check_plan(one(plans)?)?,
            Trainee::Mamba(m) => m.check_plan(one(plans)?)?,
            Trainee::Hybrid(m) => m.check_plans(plans)?,
        }
        Ok(())
    }

    fn trainable(&self, mode: Mode) -> usize {
        match self {
            Trainee::Qwen3(m) => m.trainable(mode),
            Trainee::Mamba(m) => m.trainable(mode),
            Trainee::Hybrid(m) => m.trainable(mode),
        }
    }

    /// `(layers, hidden)`.
    fn size(&self) -> (usize, usize) {
        match self {
            Trainee::Qwen3(m) => (m.dims.layers, m.dims.hidden),
            Trainee::Mamba(m) => (m.dims.layers, m.dims.hidden),
            Trainee::Hybrid(m) => (m.layers.len(), m.embed.shape.get(1).copied().unwrap_or(0)),
        }
    }

    fn parts(&mut self) -> Parts<'_> {
        match self {
            Trainee::Qwen3(m) => Parts {
                embed: &mut m.embed,
                final_norm: &mut m.final_norm,
                lm_head: &mut m.lm_head,
                layers: &mut m.layers,
                adapters: m.lora.as_mut().map(|(_, a)| a),
            },
            Trainee::Mamba(m) => Parts {
                embed: &mut m.embed,
                final_norm: &mut m.final_norm,
                lm_head: &mut m.lm_head,
                layers: &mut m.layers,
                adapters: m.lora.as_mut().map(|(_, a)| a),
            },
            Trainee::Hybrid(m) => Parts {
                embed: &mut m.embed,
                final_norm: &mut m.final_norm,
                lm_head: &mut m.lm_head,
                layers: &mut m.layers,
                adapters: m.lora.as_mut().map(|(_, a)| a),
            },
        }
    }
}

/// One optimizer step over what `mode` trains: every parameter, or the LoRA adapters.
fn apply(opt: &mut AdamW, model: &mut Trainee, grads: &SpecGrads, mode: Mode) -> Result<()> {
    opt.begin_step();
    let model = model.parts();
    match mode {
        Mode::Full => {
            opt.update("embed", &mut model.embed.data, &grads.embed)?;
            opt.update("final_norm", &mut model.final_norm.data, &grads.final_norm)?;
            opt.update("lm_head", &mut model.lm_head.data, &grads.lm_head)?;
            for (l, (params, g)) in model.layers.iter_mut().zip(&grads.layers).enumerate() {
                for (name, grad) in g {
                    if let Some(p) = params.get_mut(name) {
                        opt.update(&format!("{l}.{name}"), &mut p.data, grad)?;
                    }
                }
            }
        }
        Mode::Lora => {
            let Some(adapters) = model.adapters else {
                return Ok(());
            };
            for (l, (layer, g)) in adapters.iter_mut().zip(&grads.adapters).enumerate() {
                for (target, grad) in g {
                    if let Some(a) = layer.get_mut(target) {
                        opt.update(&format!("{l}.{target}.A"), &mut a.a.data, &grad.a)?;
                        opt.update(&format!("{l}.{target}.B"), &mut a.b.data, &grad.b)?;
                    }
                }
            }
        }
    }
    Ok(())
}

/// One plan per block type of a hybrid config (in order of first use), each compiled from
/// the type's shipped spec against the type's own config.
pub fn hybrid_plans(config: &ModelConfig, mode: Mode) -> Result<Vec<Plan>> {
    let types = hybrid::layer_types(config)?;
    let mut seen: Vec<&str> = Vec::new();
    let mut plans = Vec::new();
    for t in &types {
        if seen.contains(&t.as_str()) {
            continue;
        }
        seen.push(t);
        let shipped = ShippedBlock::by_name(t).ok_or_else(|| {
            SessionError::invalid(format!(
                "`layer_types` names `{t}`, which has no shipped spec"
            ))
        })?;
        let block_config = hybrid::block_config(config, t, types.len());
        plans.push(
            compile(&shipped.spec()?, &block_config, mode)
                .during_with(|| format!("compiling {} for the `{t}` layers", shipped.spec_file))?,
        );
    }
    Ok(plans)
}

/// `--policy auto`: profiles the model on the first batch and replaces `plans` by the
/// mix of keep, recompute and offload per layer and slot that fits `budget` (with the
/// parameters already in `pool` and the optimizer state to come) at the least predicted
/// step time; reports the mix as [`Progress::Mixed`].
fn auto_plans(
    model: &Trainee,
    plans: &[Plan],
    setup: &SpecTrainSetup,
    budget: u64,
    pool: &Arc<MemoryPool>,
    task: &Task,
    progress: &mut (dyn FnMut(Progress<'_>) + Send),
) -> Result<Vec<Plan>> {
    let mode = setup.mode;
    let layer_block = match model {
        Trainee::Hybrid(m) => m.layer_block.clone(),
        _ => vec![0; model.size().0],
    };
    let mix_model = mix_model(plans, layer_block, mode)?;
    let batch = task.batch(setup.seed, 0, setup.batch);
    // A failed step is reported with its causes.
    let step = |plans: &[Plan], env: StepEnv| {
        model
            .step(plans, &batch.tokens, &batch.targets, env)
            .map_err(|e| Chain(&e).to_string())
    };
    progress(Progress::Profiling);
    let profile = profile(&mix_model, 3, &step)?;
    // AdamW's two moments per trained value join the parameters from the first update on.
    let base = pool.live() + 8 * model.trainable(mode) as u64;
    let tuned = choose(&mix_model, &profile, budget, base, TUNE_ROUNDS, &step)?;
    progress(Progress::Mixed {
        model: &mix_model,
        profile: &profile,
        tuned: &tuned,
        base,
    });
    let choices: Vec<_> = tuned
        .mix()
        .layers
        .iter()
        .map(|l| l.choice.clone())
        .collect();
    Ok(mix_model.plans(&choices)?)
}

/// Trains the spec-driven model `setup` describes on `task`: resolves its block and spec,
/// makes the pool (`setup.memory_budget`) and the thread pool, and runs the steps, telling
/// `progress` what happens; returns what the run measured.
pub fn run(
    setup: &SpecTrainSetup,
    task: &Task,
    progress: &mut (dyn FnMut(Progress<'_>) + Send),
) -> Result<SpecTrainSummary> {
    let (kind, spec, source) = resolve_block(setup.spec, setup.block)?;
    let pool = match setup.memory_budget {
        Some(budget) => MemoryPool::with_budget(budget),
        None => MemoryPool::unbounded(),
    };
    let ctx = ExecContext::new(Arc::clone(&pool), setup.threads)?;
    ctx.install(|| train(setup, task, kind, spec, &source, pool, progress))
}

/// The spec (none for a hybrid) and the config a block runs with, before `--block-set`.
fn spec_and_config(
    kind: Block,
    spec: Option<BlockSpec>,
    block_config: Option<&Path>,
) -> Result<(Option<BlockSpec>, ModelConfig)> {
    if kind == Block::Hybrid {
        let config = match block_config {
            Some(path) => ModelConfig::load(path)?,
            None => ModelConfig::parse(HYBRID_CONFIG_TEXT, HYBRID_CONFIG_FILE)?,
        };
        Ok((None, config))
    } else {
        let (shipped_spec, config) = load_spec_and_config(kind.name(), block_config, &[])?;
        Ok((Some(spec.unwrap_or(shipped_spec)), config))
    }
}

fn train(
    setup: &SpecTrainSetup,
    task: &Task,
    kind: Block,
    spec: Option<BlockSpec>,
    spec_source: &str,
    pool: Arc<MemoryPool>,
    progress: &mut (dyn FnMut(Progress<'_>) + Send),
) -> Result<SpecTrainSummary> {
    let (spec, mut config) = spec_and_config(kind, spec, setup.block_config)?;
    check_block_sets(kind, setup.block_set, &config, spec.as_ref())?;
    for assignment in setup.block_set {
        config.apply_override(assignment)?;
    }
    let as_int = |what: &str, n: usize| {
        i64::try_from(n).map_err(|_| SessionError::invalid(format!("{what} {n} is too large")))
    };
    config = config
        .set(
            "vocab_size",
            Value::Int(as_int("vocab_size", task.vocab())?),
        )
        .set("batch", Value::Int(as_int("--batch", setup.batch)?))
        .set("seq_len", Value::Int(as_int("seq_len", task.seq())?));
    let plans: Vec<Plan> = match &spec {
        Some(spec) => vec![
            compile(spec, &config, setup.mode)
                .during_with(|| format!("compiling {spec_source}"))?,
        ],
        None => hybrid_plans(&config, setup.mode)?,
    };
    // Before the model exists: a spec the runtime cannot run fails in milliseconds.
    for plan in &plans {
        check::check_dtypes(plan).during_with(|| format!("spec {}", plan.spec().name))?;
    }
    let lora = (setup.mode == Mode::Lora).then(|| LoraConfig {
        rank: setup.lora_rank,
        alpha: setup.lora_alpha,
        dropout: setup.lora_dropout,
        targets: kind.lora_targets().iter().map(|t| t.to_string()).collect(),
        seed: setup.seed ^ 0x10ba,
    });
    // The parameters' bytes come from the dims alone, so an impossible model is refused by
    // the budget before a single weight is allocated (and the weights are allocated
    // fallibly when there is no budget).
    let lora_sizes = lora.as_ref().map(|l| (l.rank, l.targets.as_slice()));
    let block_config = &one(&plans)?.config;
    let param_count = match kind {
        Block::Qwen3(k) => Some(Qwen3Dims::from_config(block_config, k)?.param_count(lora_sizes)?),
        Block::Mamba => Some(MambaDims::from_config(block_config)?.param_count(lora_sizes)?),
        // Counted once built (below): its layers' sizes come from several block configs.
        Block::Hybrid => None,
    };
    let reserve = |count: u64| -> Result<Reservation> {
        let bytes = count.checked_mul(4).ok_or_else(|| {
            SessionError::invalid("the model's parameter bytes overflow a 64-bit count")
        })?;
        Ok(pool
            .reserve(bytes, Category::Parameters, None)
            .map_err(|oom| oom.at("model parameters"))?)
    };
    let mut _params = param_count.map(reserve).transpose()?;
    let mut model = match kind {
        Block::Qwen3(k) => Trainee::Qwen3(Qwen3::new(k, block_config, setup.seed)?),
        Block::Mamba => Trainee::Mamba(Mamba::new(block_config, setup.seed)?),
        Block::Hybrid => Trainee::Hybrid(Hybrid::new(&config, setup.seed)?),
    };
    if kind == Block::Hybrid
        && let Some(flag) = [("--init", setup.init), ("--dump-grads", setup.dump_grads)]
            .iter()
            .find_map(|(flag, path)| path.map(|_| *flag))
    {
        return Err(SessionError::invalid(format!(
            "{flag} does not apply to --block hybrid: its layers of several block types have no single Hugging Face model (use it with --block qwen3, qwen3-moe or mamba)"
        )));
    }
    if let Some(path) = setup.init {
        // The error names the file and the tensor.
        match &mut model {
            Trainee::Qwen3(m) => qwen3::hf::load_params(m, path).during("--init")?,
            Trainee::Mamba(m) => mamba::hf::load_params(m, path).during("--init")?,
            Trainee::Hybrid(_) => {
                return Err(SessionError::invalid(
                    "--init does not apply to --block hybrid",
                ));
            }
        }
        progress(Progress::Loaded(path));
    }
    if let Some(path) = setup.dump_grads {
        if setup.mode != Mode::Full {
            return Err(SessionError::invalid(
                "--dump-grads needs --mode full: under LoRA the step computes adapter gradients only",
            ));
        }
        // Before training: a directory or device there would only fail after the step.
        check_target(path).during("--dump-grads")?;
    }
    if let Some(lora) = lora {
        model = match model {
            Trainee::Qwen3(m) => Trainee::Qwen3(m.with_lora(lora, false)?),
            Trainee::Mamba(m) => Trainee::Mamba(m.with_lora(lora, false)?),
            Trainee::Hybrid(m) => Trainee::Hybrid(m.with_lora(lora, false)?),
        };
    }
    if _params.is_none() {
        let count = model.trainable(Mode::Full) + model.trainable(Mode::Lora);
        _params = Some(reserve(count as u64)?);
    }
    model
        .check_plans(&plans)
        .during_with(|| format!("spec {spec_source}"))?;
    let plans = match setup.auto_budget {
        Some(budget) => auto_plans(&model, &plans, setup, budget, &pool, task, progress)?,
        None => plans,
    };
    let (layers, hidden) = model.size();
    progress(Progress::Started(&Started {
        block: kind.name(),
        spec_source,
        mode: setup.mode,
        layers,
        hidden,
        trainable: model.trainable(setup.mode),
    }));
    let host = HostStore::in_memory();
    let meter = Meter::new(Arc::clone(&pool));
    let mut opt = AdamW::new(setup.lr, Arc::clone(&pool));
    let start = Instant::now();
    let (mut first, mut last) = (None, 0.0f32);
    let (mut peak, mut saved, mut shared, mut host_peak) = (0u64, 0u64, 0u64, 0u64);
    for step in 0..setup.steps {
        let batch = task.batch(setup.seed, step, setup.batch);
        let env = StepEnv {
            host: &host,
            meter: &meter,
            step,
        };
        let (grads, stats) = model
            .step(&plans, &batch.tokens, &batch.targets, env)
            .during_with(|| format!("step {step}"))?;
        if let Some(path) = setup.dump_grads.filter(|_| step == 0) {
            let loss = f64::from(stats.loss);
            match &model {
                Trainee::Qwen3(m) => qwen3::hf::save_grads(path, m, &grads, &batch, loss),
                Trainee::Mamba(m) => mamba::hf::save_grads(path, m, &grads, &batch, loss),
                Trainee::Hybrid(_) => {
                    return Err(SessionError::invalid(
                        "--dump-grads does not apply to --block hybrid",
                    ));
                }
            }
            .during("--dump-grads")?;
            progress(Progress::DumpedGrads(path));
        }
        apply(&mut opt, &mut model, &grads, setup.mode).during_with(|| format!("step {step}"))?;
        drop(grads);
        first.get_or_insert(stats.loss);
        last = stats.loss;
        peak = peak.max(pool.peak());
        saved = saved.max(stats.activations.saved_peak);
        shared = shared.max(stats.activations.shared_peak);
        host_peak = host_peak.max(stats.host_peak);
        progress(Progress::Step {
            step,
            loss: stats.loss,
        });
    }
    Ok(SpecTrainSummary {
        first_loss: first,
        last_loss: last,
        pool_peak: peak,
        saved_peak: saved,
        shared_peak: shared,
        host_peak,
        seconds: start.elapsed().as_secs_f64(),
    })
}
