//! `remat train --stages P`: pipelined training of the GPT. The blocks are split over `P`
//! stages (the first also owns the embedding, the last the final norm, LM head and loss),
//! each on its own thread with its own memory pool; each step's batch is cut into
//! `--micro-batches` micro-batches streamed through the stages under `--schedule`, with
//! `--stage-policy` deciding per micro-batch whether a stage keeps its activations until
//! backward or recomputes them. At the end: per stage, peak memory and busy time, and the
//! measured bubble fraction against the ideal `(P-1)/(M+P-1)`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use remat_engine::models::gpt::{Batch, Gpt};
use remat_engine::pipeline::driver::{Pipeline, StageResources, StepReport};
use remat_engine::pipeline::staged_gpt::{StagedGpt, split_batch};
use remat_engine::pipeline::{PipelineConfig, Schedule, Strategy};
use remat_engine::{AdamWConfig, Category, MemoryPool};

use super::train::table::render;
use super::train::{Args, format_bytes};

/// The pipeline flags of `remat train`.
#[derive(clap::Args, Debug, Clone)]
pub struct PipelineArgs {
    /// Train pipelined over this many stages (each its own thread and memory pool; the
    /// --memory-budget applies to each stage).
    #[arg(long)]
    pub stages: Option<usize>,
    /// Micro-batches per step (they split --batch evenly). Only with --stages.
    #[arg(long, default_value_t = 8, requires = "stages")]
    pub micro_batches: usize,
    /// Pipeline schedule: gpipe or 1f1b. Only with --stages.
    #[arg(long, default_value = "1f1b", value_parser = parse_schedule, requires = "stages")]
    pub schedule: Schedule,
    /// Per-stage activation checkpointing across micro-batches: store-all, recompute-all,
    /// selective:N (keep every N-th and the first and last), memory:BYTES (keep while
    /// under BYTES, evicting the oldest). Only with --stages.
    #[arg(long, default_value = "store-all", value_parser = parse_strategy, requires = "stages")]
    pub stage_policy: Strategy,
}

fn parse_schedule(s: &str) -> Result<Schedule, String> {
    s.parse()
        .map_err(|e: remat_engine::pipeline::schedule::ScheduleError| e.to_string())
}

/// `memory:BYTES` reads BYTES with --memory-budget's parser (TiB, any case, decimals), so
/// the two flags accept the same sizes; the rest is the engine's parser.
fn parse_strategy(s: &str) -> Result<Strategy, String> {
    if let Some(bytes) = s.strip_prefix("memory:") {
        let bytes =
            super::train::parse_bytes(bytes).map_err(|e| format!("stage policy `{s}`: {e}"))?;
        let threshold_bytes = usize::try_from(bytes)
            .map_err(|_| format!("stage policy `{s}`: {bytes} bytes is too large"))?;
        return Ok(Strategy::MemoryBased { threshold_bytes });
    }
    s.parse()
        .map_err(|e: remat_engine::pipeline::manager::StrategyParseError| e.to_string())
}

/// Where the training batches come from (the task lives with `remat train`).
pub struct TaskSource<'a> {
    pub vocab: usize,
    pub description: String,
    /// Batch of step `step` (deterministic in the seed).
    pub batch: &'a dyn Fn(u64) -> Batch,
}

/// Totals over the steps, per stage.
struct Totals {
    busy: Vec<Duration>,
    recompute: Vec<Duration>,
    recomputes: Vec<usize>,
    wall: Duration,
    peak: Vec<u64>,
    peak_activations: Vec<u64>,
}

impl Totals {
    fn new(stages: usize) -> Self {
        Self {
            busy: vec![Duration::ZERO; stages],
            recompute: vec![Duration::ZERO; stages],
            recomputes: vec![0; stages],
            wall: Duration::ZERO,
            peak: vec![0; stages],
            peak_activations: vec![0; stages],
        }
    }

    fn add(&mut self, step: &StepReport) {
        self.wall += step.run.wall;
        for (s, st) in step.run.stages.iter().enumerate() {
            self.busy[s] += st.busy;
            self.recompute[s] += st.recompute;
            self.recomputes[s] += st.checkpoint.recomputes;
        }
        for (s, mem) in step.memory.iter().enumerate() {
            self.peak[s] = self.peak[s].max(mem.peak);
            let act = mem.category(Category::Activations).peak;
            self.peak_activations[s] = self.peak_activations[s].max(act);
        }
    }

    /// Idle share of all stages' time over every step.
    fn bubble(&self) -> f64 {
        let capacity = self.wall.as_secs_f64() * self.busy.len() as f64;
        if capacity <= 0.0 {
            return 0.0;
        }
        let busy: f64 = self.busy.iter().map(Duration::as_secs_f64).sum();
        (1.0 - busy / capacity).max(0.0)
    }
}

/// The most pipeline stages remat runs: each stage is a thread with its own memory pool, so
/// far more stages than cores only time-share them, and an absurd count (`--stages
/// 18446744073709551615`) must fail here rather than in an allocation for that many blocks.
pub const MAX_STAGES: usize = 64;

/// The most micro-batches per step: the schedule and the per-stage bookkeeping grow with the
/// count, and each micro-batch needs at least one sequence.
pub const MAX_MICRO_BATCHES: usize = 4096;

/// Checks --stages alone, before it is used to size anything (it may raise --layers).
fn check_stages(stages: usize) -> anyhow::Result<()> {
    anyhow::ensure!(stages >= 1, "--stages must be at least 1");
    anyhow::ensure!(
        stages <= MAX_STAGES,
        "--stages {stages} is more than remat runs ({MAX_STAGES}): each stage is a thread with its own memory pool"
    );
    Ok(())
}

/// Checks a micro-batch count against the sequences it splits.
pub fn check_micro_batches(micro_batches: usize) -> anyhow::Result<()> {
    anyhow::ensure!(
        (1..=MAX_MICRO_BATCHES).contains(&micro_batches),
        "--micro-batches {micro_batches} must be between 1 and {MAX_MICRO_BATCHES}"
    );
    Ok(())
}

fn check_flags(args: &Args, stages: usize) -> anyhow::Result<()> {
    let p = &args.pipeline;
    check_stages(stages)?;
    check_micro_batches(p.micro_batches)?;
    anyhow::ensure!(
        stages <= args.layers(),
        "--stages {stages} exceeds --layers {}: every stage needs at least one block",
        args.layers()
    );
    let store_all = super::train_auto::PolicyChoice::Fixed(
        super::train::parse_policy("store-all").map_err(anyhow::Error::msg)?,
    );
    anyhow::ensure!(
        args.policy == store_all,
        "--policy cannot be combined with --stages: each stage keeps or recomputes its \
         micro-batches' activations by --stage-policy (store-all, recompute-all, selective:N, \
         memory:BYTES)"
    );
    anyhow::ensure!(
        p.micro_batches >= 1 && args.batch.is_multiple_of(p.micro_batches),
        "--batch {} must split evenly into --micro-batches {}",
        args.batch,
        p.micro_batches
    );
    anyhow::ensure!(
        !args.compare,
        "--compare runs single-stage policies; use `remat bench pipeline` to compare schedules"
    );
    anyhow::ensure!(
        args.files.init.is_none() && args.files.dump_grads.is_none(),
        "--init and --dump-grads are for single-stage training, not with --stages"
    );
    anyhow::ensure!(
        args.files.swap_dir.is_none(),
        "--swap-dir is for --policy auto (single-stage training), not with --stages: pipeline stages keep or recompute activations by --stage-policy and never swap"
    );
    Ok(())
}

/// Runs pipelined training; called by `remat train` when `--stages` is given.
pub fn run(args: &Args, stages: usize, task: &TaskSource<'_>) -> anyhow::Result<()> {
    // Before --stages sizes anything: it may raise the layer count below.
    check_stages(stages)?;
    // Every stage needs a block: without --layers, the default depth grows to the stages.
    let mut raised = args.clone();
    if args.layers.is_none() && stages > args.layers() {
        raised.layers = Some(stages);
        println!(
            "--stages {stages} needs at least {stages} blocks: using --layers {stages} (the default is {}; give --layers to choose)",
            args.layers()
        );
    }
    let args = &raised;
    check_flags(args, stages)?;
    let p = &args.pipeline;
    let config = args.model_config(task.vocab);
    let model = Gpt::new(&MemoryPool::unbounded(), config).context("building the GPT")?;
    let staged = StagedGpt(&model);
    let threads = (args.threads() / stages).max(1);
    let resources = StageResources {
        threads,
        budget: args.memory_budget,
    };
    let mut pipeline = Pipeline::new(&staged, stages, resources)?;
    println!(
        "pipeline: {stages} stages x {threads} thread(s), {} micro-batches of {} sequences, schedule {}, stage policy {}",
        p.micro_batches,
        args.batch / p.micro_batches,
        p.schedule,
        p.stage_policy
    );
    println!("task: {}", task.description);
    let run_config = PipelineConfig {
        schedule: p.schedule,
        micro_batches: p.micro_batches,
        strategy: p.stage_policy,
    };
    let adam = AdamWConfig {
        lr: args.lr,
        ..AdamWConfig::default()
    };
    let log_every = args.log_every.unwrap_or((args.steps / 15).max(1));
    let bar = ProgressBar::new(args.steps);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} steps {msg} [{elapsed} < {eta}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut totals = Totals::new(stages);
    let started = Instant::now();
    for step in 0..args.steps {
        let batch = (task.batch)(step);
        let micro = split_batch(&batch, p.micro_batches)?;
        let report = pipeline
            .step(
                Arc::from(micro),
                args.seed ^ step.rotate_left(32),
                run_config,
            )
            .with_context(|| format!("training step {step}"))?;
        pipeline.optimizer_step(adam)?;
        totals.add(&report);
        let loss = report.mean_loss();
        bar.set_message(format!("loss {loss:.4}"));
        if step % log_every == 0 || step + 1 == args.steps {
            // Through suspend, not bar.println: a hidden bar (no terminal) swallows println.
            bar.suspend(|| println!("step {step:>5}  loss {loss:.4}"));
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    print_summary(
        &pipeline,
        &totals,
        run_config,
        args.steps,
        started.elapsed(),
    );
    Ok(())
}

fn print_summary(
    pipeline: &Pipeline<'_, StagedGpt<'_>>,
    totals: &Totals,
    config: PipelineConfig,
    steps: u64,
    elapsed: Duration,
) {
    let header = [
        "stage",
        "blocks",
        "peak memory",
        "peak activations",
        "busy",
        "busy share",
        "recomputes",
    ];
    let wall = totals.wall.as_secs_f64().max(f64::MIN_POSITIVE);
    let rows: Vec<Vec<String>> = pipeline
        .stages()
        .iter()
        .enumerate()
        .map(|(s, stage)| {
            let r = stage.layer_range();
            vec![
                s.to_string(),
                format!("{}..{}", r.start, r.end),
                format_bytes(totals.peak[s]),
                format_bytes(totals.peak_activations[s]),
                format!("{:.3} s", totals.busy[s].as_secs_f64()),
                format!("{:.1}%", 100.0 * totals.busy[s].as_secs_f64() / wall),
                totals.recomputes[s].to_string(),
            ]
        })
        .collect();
    println!("\n{}", render(&header, &rows));
    let stages = pipeline.stages().len();
    let ideal =
        remat_engine::pipeline::schedule::ideal_bubble_fraction(stages, config.micro_batches);
    println!(
        "bubble fraction: measured {:.3}, ideal (P-1)/(M+P-1) = {ideal:.3}",
        totals.bubble()
    );
    println!(
        "{steps} steps in {:.2} s ({:.3} s per step in the pipeline)",
        elapsed.as_secs_f64(),
        wall / steps.max(1) as f64
    );
}
