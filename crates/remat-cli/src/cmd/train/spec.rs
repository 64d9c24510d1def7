//! `remat train --block qwen3|qwen3-moe|mamba [--spec FILE] [--mode full|lora]`: trains a
//! Qwen3-style or Mamba model whose blocks run through a compiled recompute spec, on the same task as
//! `remat train` (the embedded reversal task or `--data`). `--spec FILE` alone names its
//! block. Every buffer (parameters, optimizer state, gradients, activations, scratch) is
//! charged to one memory pool, so `--memory-budget` applies and the reported peak is
//! measured; flags of the GPT path that would do nothing here are refused.
//!
//! Why ~690 lines: besides this mode's flags and printing, it still holds the spec models'
//! training loop and an AdamW over named buffers, flow that belongs in the engine's
//! `session` beside the GPT path's; moving it there is open work (DEVELOPERS.md, #29).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use remat_engine::core::pool::{Category, MemoryPool, Reservation};
use remat_engine::core::swap::HostStore;
use remat_engine::session::spec_mix::{TUNE_ROUNDS, choose, mix_model, profile};
use remat_engine::session::task::Task;
use remat_engine::spec::Plan;
use remat_engine::spec::models::hybrid::{self, Hybrid};
use remat_engine::spec::models::mamba::{self, Mamba, MambaDims};
use remat_engine::spec::models::qwen3::{self, BlockKind, Qwen3, Qwen3Dims};
use remat_engine::spec::models::{SpecGrads, StepEnv, StepStats};
use remat_engine::spec::run::Act;
use remat_engine::spec::run::check;
use remat_engine::spec::run::lora::LayerAdapters;
use remat_engine::spec::run::lora::LoraConfig;
use remat_engine::spec::run::meter::Meter;
use remat_engine::spec::shipped::{HYBRID_CONFIG_FILE, HYBRID_CONFIG_TEXT};
use remat_engine::spec::{BlockSpec, Mode, ModelConfig, Value, compile};
use remat_report::{Layout, print_table};
use remat_units::human_bytes;

use super::flags::{Args, PolicyChoice, SpecArgs, parse_policy};
use crate::specs::{load_spec_and_config, print_mix, print_tuned};

/// AdamW over named f32 buffers (moments created on first use, charged to the pool).
struct AdamW {
    lr: f32,
    step: i32,
    moments: BTreeMap<String, (Vec<f32>, Vec<f32>)>,
    pool: Arc<MemoryPool>,
    held: Vec<Reservation>,
}

impl AdamW {
    const BETA1: f32 = 0.9;
    const BETA2: f32 = 0.999;
    const EPS: f32 = 1e-8;
    const WEIGHT_DECAY: f32 = 0.01;

    fn update(&mut self, name: &str, param: &mut [f32], grad: &[f32]) -> anyhow::Result<()> {
        if !self.moments.contains_key(name) {
            let bytes = 2 * 4 * param.len() as u64;
            let r = self
                .pool
                .reserve(bytes, Category::OptimizerState, None)
                .map_err(|oom| oom.at(format!("AdamW moments of `{name}`")))?;
            self.held.push(r);
        }
        let (m, v) = self
            .moments
            .entry(name.to_string())
            .or_insert_with(|| (vec![0.0; param.len()], vec![0.0; param.len()]));
        let (c1, c2) = (
            1.0 - Self::BETA1.powi(self.step),
            1.0 - Self::BETA2.powi(self.step),
        );
        for i in 0..param.len() {
            m[i] = Self::BETA1 * m[i] + (1.0 - Self::BETA1) * grad[i];
            v[i] = Self::BETA2 * v[i] + (1.0 - Self::BETA2) * grad[i] * grad[i];
            let update = (m[i] / c1) / ((v[i] / c2).sqrt() + Self::EPS);
            param[i] -= self.lr * (update + Self::WEIGHT_DECAY * param[i]);
        }
        Ok(())
    }
}

/// The block a spec-driven run stacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    Qwen3(BlockKind),
    Mamba,
    /// A block type per layer (`layer_types`), each under its shipped spec.
    Hybrid,
}

impl Block {
    fn name(self) -> &'static str {
        match self {
            Block::Qwen3(kind) => kind.spec_name(),
            Block::Mamba => mamba::BLOCK,
            Block::Hybrid => "hybrid",
        }
    }

    /// The block named exactly `name`.
    fn from_name(name: &str) -> Option<Self> {
        match name {
            mamba::BLOCK => Some(Block::Mamba),
            "hybrid" => Some(Block::Hybrid),
            _ => BlockKind::from_name(name).map(Block::Qwen3),
        }
    }

    /// The block a spec is written for: its name exactly, or with `-derived` / `-save-all`.
    fn of_spec(spec_name: &str) -> Option<Self> {
        let base = ["-derived", "-save-all"]
            .iter()
            .find_map(|suffix| spec_name.strip_suffix(suffix))
            .unwrap_or(spec_name);
        // A hybrid is a config of several specs, never one spec's name.
        Self::from_name(base).filter(|b| *b != Block::Hybrid)
    }

    /// Whether `--block-set` may set `key`: one the model reads; for a hybrid, a common
    /// key or `TYPE.KEY` with a key that block type reads.
    fn reads_key(self, key: &str) -> bool {
        match self {
            Block::Qwen3(_) => qwen3::CONFIG_KEYS.contains(&key),
            Block::Mamba => mamba::CONFIG_KEYS.contains(&key),
            Block::Hybrid => match key.split_once('.') {
                Some(("mamba", k)) => mamba::CONFIG_KEYS.contains(&k),
                Some(("qwen3" | "qwen3-moe", k)) => qwen3::CONFIG_KEYS.contains(&k),
                Some(_) => false,
                None => ["layer_types", "hidden_size", "rms_norm_eps"].contains(&key),
            },
        }
    }

    fn config_keys(self) -> String {
        match self {
            Block::Qwen3(_) => qwen3::CONFIG_KEYS.join(", "),
            Block::Mamba => mamba::CONFIG_KEYS.join(", "),
            Block::Hybrid => "layer_types, hidden_size, rms_norm_eps, and TYPE.KEY for a key of block TYPE (mamba, qwen3, qwen3-moe)".into(),
        }
    }

    fn lora_targets(self) -> &'static [&'static str] {
        match self {
            Block::Qwen3(_) => &["q", "k", "v", "o", "gate", "up", "down"],
            Block::Mamba => mamba::LORA_TARGETS,
            Block::Hybrid => &["q", "k", "v", "o", "gate", "up", "down", "in", "x", "out"],
        }
    }
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

impl Trainee {
    /// One step under `plans`: one plan, or one per block type of a hybrid.
    fn step(
        &self,
        plans: &[Plan],
        tokens: &[u32],
        targets: &[u32],
        env: StepEnv,
    ) -> anyhow::Result<(SpecGrads, StepStats)> {
        let one = || plans.first().context("no plan");
        Ok(match self {
            Trainee::Qwen3(m) => m.step(one()?, tokens, targets, env)?,
            Trainee::Mamba(m) => m.step(one()?, tokens, targets, env)?,
            Trainee::Hybrid(m) => m.step(plans, tokens, targets, env)?,
        })
    }

    fn check_plans(&self, plans: &[Plan]) -> anyhow::Result<()> {
        let one = || plans.first().context("no plan");
        match self {
            Trainee::Qwen3(m) => m.check_plan(one()?)?,
            Trainee::Mamba(m) => m.check_plan(one()?)?,
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
            Trainee::Hybrid(m) => (m.layers.len(), m.embed.shape[1]),
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

fn apply(
    opt: &mut AdamW,
    model: &mut Trainee,
    grads: &SpecGrads,
    mode: Mode,
) -> anyhow::Result<()> {
    opt.step += 1;
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

fn block_kind(name: &str) -> anyhow::Result<Block> {
    Block::from_name(name).ok_or_else(|| {
        anyhow::anyhow!("unknown --block `{name}` (expected exactly qwen3, qwen3-moe or mamba)")
    })
}

/// `remat train` flags that the spec-driven path does not use: refused rather than ignored.
/// The spec decides what each layer keeps, recomputes or offloads, so a checkpointing
/// policy or pipeline stages would silently do nothing.
fn reject_unused_flags(args: &Args) -> anyhow::Result<()> {
    let flag = if let PolicyChoice::Auto(strategy) = &args.policy {
        match (strategy, args.memory_budget) {
            (Some(_), _) => Some("--policy auto:STRATEGY"),
            (None, None) => anyhow::bail!(
                "--policy auto with --block/--spec needs --memory-budget: the mix of keep, recompute and offload is chosen to fit it"
            ),
            (None, Some(_)) => None,
        }
    } else if args.policy.fixed()? != parse_policy("store-all").map_err(anyhow::Error::msg)? {
        Some("--policy")
    } else if args.pipeline.stages.is_some() {
        Some("--stages")
    } else if args.compare {
        Some("--compare")
    } else if args.files.swap_dir.is_some() {
        Some("--swap-dir")
    } else {
        None
    };
    match flag {
        Some(flag) => anyhow::bail!(
            "{flag} does not apply with --block/--spec: the spec decides what each layer saves, recomputes or offloads (edit the spec, or see `remat spec inspect`), or --policy auto with --memory-budget chooses a mix per layer and slot"
        ),
        None => Ok(()),
    }
}

/// The block and spec to train: `--spec FILE` names its block (exactly `qwen3`,
/// `qwen3-moe` or `mamba`, or those with `-derived`); `--block`, when also given, must agree.
fn resolve_block(sa: &SpecArgs) -> anyhow::Result<(Block, Option<BlockSpec>, String)> {
    let Some(path) = &sa.spec else {
        let block = sa.block.as_deref().unwrap_or("qwen3");
        return Ok((block_kind(block)?, None, block.to_string()));
    };
    let source = path.display().to_string();
    let spec = BlockSpec::load(path)?;
    let Some(kind) = Block::of_spec(&spec.name) else {
        anyhow::bail!(
            "spec {source} is for block `{}`; remat trains qwen3, qwen3-moe and mamba (a spec's `name` must be exactly one of them, or end in -derived)",
            spec.name
        );
    };
    if let Some(block) = &sa.block
        && block_kind(block)? != kind
    {
        anyhow::bail!(
            "--block {block} but spec {source} is for block `{}`; drop --block (it is inferred from the spec) or pass --block {}",
            spec.name,
            kind.name()
        );
    }
    Ok((kind, Some(spec), source))
}

/// `--block-set KEY=VALUE` may set only keys the model or the spec reads, and never the
/// ones the task decides (`vocab_size`, `batch`, `seq_len`): those would be overwritten
/// without a word.
fn check_block_sets(
    block: Block,
    sets: &[String],
    config: &remat_engine::spec::ModelConfig,
    spec: Option<&BlockSpec>,
) -> anyhow::Result<()> {
    for assignment in sets {
        let key = assignment
            .split_once('=')
            .map(|(k, _)| k.trim())
            .with_context(|| format!("--block-set `{assignment}` is not KEY=VALUE"))?;
        let from_task = match key {
            "vocab_size" => Some("the task's vocabulary (--digits or --data)"),
            "batch" => Some("--batch"),
            "seq_len" => {
                Some("the task's sequence length (--digits N gives 2N, or --data FILE --seq N)")
            }
            _ => None,
        };
        if let Some(flag) = from_task {
            anyhow::bail!("--block-set {key}: `{key}` is set by {flag}, not by --block-set");
        }
        let known = block.reads_key(key)
            || config.get(key).is_some()
            || spec.is_some_and(|s| {
                s.config_defaults.contains_key(key) || spec_names(s).any(|name| name == key)
            });
        anyhow::ensure!(
            known,
            "--block-set {key}: `{key}` is not a key the {} model, its config or spec reads (known: {})",
            block.name(),
            block.config_keys()
        );
    }
    Ok(())
}

/// Every name a spec's dims, shapes and conditions mention (a superset of the config keys
/// it reads).
fn spec_names(spec: &BlockSpec) -> impl Iterator<Item = &str> {
    let texts = spec
        .dims
        .values()
        .map(String::as_str)
        .chain(spec.slots.iter().filter_map(|s| s.when.as_deref()))
        .chain(spec.params.iter().filter_map(|p| p.when.as_deref()))
        .chain(
            spec.slots
                .iter()
                .flat_map(|s| s.shape.iter().map(String::as_str)),
        )
        .chain(
            spec.params
                .iter()
                .flat_map(|p| p.shape.iter().map(String::as_str)),
        );
    texts.flat_map(|t| {
        t.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.'))
            .filter(|w| w.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_'))
    })
}

/// One plan per block type of a hybrid config (in order of first use), each compiled from
/// the type's shipped spec against the type's own config.
fn hybrid_plans(config: &ModelConfig, mode: Mode) -> anyhow::Result<Vec<Plan>> {
    let types = hybrid::layer_types(config)?;
    let mut seen: Vec<&str> = Vec::new();
    let mut plans = Vec::new();
    for t in &types {
        if seen.contains(&t.as_str()) {
            continue;
        }
        seen.push(t);
        let shipped = remat_engine::spec::shipped::ShippedBlock::by_name(t)
            .with_context(|| format!("`layer_types` names `{t}`, which has no shipped spec"))?;
        let block_config = hybrid::block_config(config, t, types.len());
        plans.push(
            compile(&shipped.spec()?, &block_config, mode)
                .with_context(|| format!("compiling {} for the `{t}` layers", shipped.spec_file))?,
        );
    }
    Ok(plans)
}

/// `--policy auto`: profiles the model on the first batch and replaces `plans` by the
/// mix of keep, recompute and offload per layer and slot that fits `budget` (with the
/// parameters already in `pool` and the optimizer state to come) at the least predicted
/// step time; prints the mix.
fn auto_plans(
    model: &Trainee,
    plans: &[Plan],
    mode: Mode,
    budget: u64,
    pool: &Arc<MemoryPool>,
    task: &Task,
    args: &Args,
) -> anyhow::Result<Vec<Plan>> {
    let layer_block = match model {
        Trainee::Hybrid(m) => m.layer_block.clone(),
        _ => vec![0; model.size().0],
    };
    let mix_model = mix_model(plans, layer_block, mode)?;
    let batch = task.batch(args.seed.one(), 0, args.batch);
    let step = |plans: &[Plan], env: StepEnv| model.step(plans, &batch.tokens, &batch.targets, env);
    println!("profiling the model for --policy auto ...");
    let profile = profile(&mix_model, 3, &step)?;
    // AdamW's two moments per trained value join the parameters from the first update on.
    let base = pool.live() + 8 * model.trainable(mode) as u64;
    let tuned = choose(&mix_model, &profile, budget, base, TUNE_ROUNDS, &step)?;
    print_tuned(&tuned, base);
    let mix = tuned.mix();
    print_mix(&mix_model, &profile, mix, base);
    let choices: Vec<_> = mix.layers.iter().map(|l| l.choice.clone()).collect();
    Ok(mix_model.plans(&choices)?)
}

/// Runs spec-driven training with `remat train`'s common flags.
pub fn run(args: &Args, task: &Task) -> anyhow::Result<()> {
    reject_unused_flags(args)?;
    let (kind, spec, source) = resolve_block(&args.spec_args)?;
    let pool = match args.memory_budget {
        Some(budget) => MemoryPool::with_budget(budget),
        None => MemoryPool::unbounded(),
    };
    let ctx = remat_engine::ExecContext::new(Arc::clone(&pool), args.threads())?;
    ctx.install(|| train(args, task, kind, spec, &source, pool))
}

fn train(
    args: &Args,
    task: &Task,
    kind: Block,
    spec: Option<BlockSpec>,
    spec_source: &str,
    pool: Arc<MemoryPool>,
) -> anyhow::Result<()> {
    let sa = &args.spec_args;
    let block = kind.name();
    let (spec, mut config) = if kind == Block::Hybrid {
        let config = match sa.block_config.as_deref() {
            Some(path) => ModelConfig::load(path)?,
            None => ModelConfig::parse(HYBRID_CONFIG_TEXT, HYBRID_CONFIG_FILE)?,
        };
        (None, config)
    } else {
        let (shipped_spec, config) = load_spec_and_config(block, sa.block_config.as_deref(), &[])?;
        (Some(spec.unwrap_or(shipped_spec)), config)
    };
    check_block_sets(kind, &sa.block_set, &config, spec.as_ref())?;
    for assignment in &sa.block_set {
        config.apply_override(assignment)?;
    }
    config = config
        .set("vocab_size", Value::Int(task.vocab() as i64))
        .set("batch", Value::Int(args.batch as i64))
        .set("seq_len", Value::Int(task.seq() as i64));
    let plans: Vec<Plan> = match &spec {
        Some(spec) => vec![
            compile(spec, &config, sa.mode).with_context(|| format!("compiling {spec_source}"))?,
        ],
        None => hybrid_plans(&config, sa.mode)?,
    };
    // Before the model exists: a spec the runtime cannot run fails in milliseconds.
    for plan in &plans {
        check::check_dtypes(plan).with_context(|| format!("spec {}", plan.spec().name))?;
    }
    let lora = (sa.mode == Mode::Lora).then(|| LoraConfig {
        rank: sa.lora_rank,
        alpha: sa.lora_alpha,
        dropout: sa.lora_dropout,
        targets: kind.lora_targets().iter().map(|t| t.to_string()).collect(),
        seed: args.seed.one() ^ 0x10ba,
    });
    // The parameters' bytes come from the dims alone, so an impossible model is refused by
    // the budget before a single weight is allocated (and the weights are allocated
    // fallibly when there is no budget).
    let lora_sizes = lora.as_ref().map(|l| (l.rank, l.targets.as_slice()));
    let block_config = &plans[0].config;
    let param_count = match kind {
        Block::Qwen3(k) => Some(Qwen3Dims::from_config(block_config, k)?.param_count(lora_sizes)?),
        Block::Mamba => Some(MambaDims::from_config(block_config)?.param_count(lora_sizes)?),
        // Counted once built (below): its layers' sizes come from several block configs.
        Block::Hybrid => None,
    };
    let reserve = |count: u64| -> anyhow::Result<Reservation> {
        let bytes = count
            .checked_mul(4)
            .context("the model's parameter bytes overflow a 64-bit count")?;
        Ok(pool
            .reserve(bytes, Category::Parameters, None)
            .map_err(|oom| oom.at("model parameters"))?)
    };
    let mut _params = param_count.map(reserve).transpose()?;
    let mut model = match kind {
        Block::Qwen3(k) => Trainee::Qwen3(Qwen3::new(k, block_config, args.seed.one())?),
        Block::Mamba => Trainee::Mamba(Mamba::new(block_config, args.seed.one())?),
        Block::Hybrid => Trainee::Hybrid(Hybrid::new(&config, args.seed.one())?),
    };
    if kind == Block::Hybrid
        && let Some(flag) = [
            ("--init", &args.files.init),
            ("--dump-grads", &args.files.dump_grads),
        ]
        .iter()
        .find_map(|(flag, path)| path.as_ref().map(|_| *flag))
    {
        anyhow::bail!(
            "{flag} does not apply to --block hybrid: its layers of several block types have no single Hugging Face model (use it with --block qwen3, qwen3-moe or mamba)"
        );
    }
    if let Some(path) = &args.files.init {
        // The error names the file and the tensor.
        match &mut model {
            Trainee::Qwen3(m) => qwen3::hf::load_params(m, path).context("--init")?,
            Trainee::Mamba(m) => mamba::hf::load_params(m, path).context("--init")?,
            Trainee::Hybrid(_) => anyhow::bail!("--init does not apply to --block hybrid"),
        }
        println!("loaded parameters from {}", path.display());
    }
    if let Some(path) = &args.files.dump_grads {
        anyhow::ensure!(
            sa.mode == Mode::Full,
            "--dump-grads needs --mode full: under LoRA the step computes adapter gradients only"
        );
        // Before training: a directory or device there would only fail after the step.
        remat_engine::models::gpt::hf::check_target(path).context("--dump-grads")?;
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
        .with_context(|| format!("spec {spec_source}"))?;
    let plans = match (&args.policy, args.memory_budget) {
        (PolicyChoice::Auto(None), Some(budget)) => {
            auto_plans(&model, &plans, sa.mode, budget, &pool, task, args)?
        }
        _ => plans,
    };
    println!(
        "{} block, spec {spec_source}, {} mode: {} layers, hidden {}, {} trainable parameters; {}{}",
        block,
        sa.mode.name(),
        model.size().0,
        model.size().1,
        model.trainable(sa.mode),
        task.describe(),
        args.memory_budget.map_or(String::new(), |b| format!(
            "; memory budget {}",
            human_bytes(b)
        ))
    );
    let host = HostStore::in_memory();
    let meter = Meter::new(Arc::clone(&pool));
    let mut opt = AdamW {
        lr: args.lr.one() as f32,
        step: 0,
        moments: BTreeMap::new(),
        pool: Arc::clone(&pool),
        held: Vec::new(),
    };
    let bar = ProgressBar::new(args.steps);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let log_every = args.log_every.unwrap_or((args.steps / 15).max(1));
    let start = Instant::now();
    let (mut first, mut last) = (None, 0.0f32);
    let (mut peak, mut saved, mut shared, mut host_peak) = (0u64, 0u64, 0u64, 0u64);
    for step in 0..args.steps {
        let batch = task.batch(args.seed.one(), step, args.batch);
        let env = StepEnv {
            host: &host,
            meter: &meter,
            step,
        };
        let (grads, stats) = model
            .step(&plans, &batch.tokens, &batch.targets, env)
            .with_context(|| format!("step {step}"))?;
        if let Some(path) = args.files.dump_grads.as_ref().filter(|_| step == 0) {
            let loss = f64::from(stats.loss);
            match &model {
                Trainee::Qwen3(m) => qwen3::hf::save_grads(path, m, &grads, &batch, loss),
                Trainee::Mamba(m) => mamba::hf::save_grads(path, m, &grads, &batch, loss),
                Trainee::Hybrid(_) => {
                    anyhow::bail!("--dump-grads does not apply to --block hybrid")
                }
            }
            .context("--dump-grads")?;
            bar.suspend(|| {
                println!(
                    "wrote the first step's gradients and its batch and loss to {}",
                    path.display()
                )
            });
        }
        apply(&mut opt, &mut model, &grads, sa.mode).with_context(|| format!("step {step}"))?;
        drop(grads);
        first.get_or_insert(stats.loss);
        last = stats.loss;
        peak = peak.max(pool.peak());
        saved = saved.max(stats.activations.saved_peak);
        shared = shared.max(stats.activations.shared_peak);
        host_peak = host_peak.max(stats.host_peak);
        bar.set_message(format!("loss {:.4}", stats.loss));
        bar.inc(1);
        if step % log_every == 0 || step + 1 == args.steps {
            // Through `suspend`: `bar.println` prints nothing when stderr is not a
            // terminal (indicatif hides the bar), so piped runs lost every loss line.
            bar.suspend(|| println!("step {step:>5}  loss {:.4}", stats.loss));
        }
    }
    bar.finish_and_clear();
    let elapsed = start.elapsed().as_secs_f64();
    let tokens = (args.steps as usize * args.batch * task.seq()) as f64;
    print_table(
        Layout::Indented,
        &[
            "first loss",
            "last loss",
            "pool peak",
            "saved slots (all layers)",
            "shared recompute buffers",
            "host store peak",
            "step time",
            "tokens/s",
        ],
        &[vec![
            format!("{:.4}", first.unwrap_or(0.0)),
            format!("{last:.4}"),
            human_bytes(peak),
            human_bytes(saved),
            human_bytes(shared),
            human_bytes(host_peak),
            format!("{:.1} ms", 1e3 * elapsed / args.steps.max(1) as f64),
            format!("{:.0}", tokens / elapsed),
        ]],
    );
    println!(
        "pool peak is measured: parameters, optimizer state, gradients, every activation and backward scratch buffer of the step"
    );
    Ok(())
}
