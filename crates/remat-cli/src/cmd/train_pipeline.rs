//! `remat train --stages P`: pipelined training of the GPT. The blocks are split over `P`
//! stages (the first also owns the embedding, the last the final norm, LM head and loss),
//! each on its own thread with its own memory pool; each step's batch is cut into
//! `--micro-batches` micro-batches streamed through the stages under `--schedule`, with
//! `--stage-policy` deciding per micro-batch whether a stage keeps its activations until
//! backward or recomputes them. At the end: per stage, peak memory and busy time, and the
//! measured bubble fraction against the ideal `(P-1)/(M+P-1)`.

mod launch;
#[cfg(feature = "mpi")]
mod mpi_run;
mod summary;

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use remat_engine::models::gpt::{Batch, Gpt, GptConfig, hf};
use remat_engine::pipeline::driver::{Pipeline, StageResources, replica_step_seed};
use remat_engine::pipeline::staged_gpt::{StagedGpt, split_batch};
use remat_engine::pipeline::{PipelineConfig, Schedule, Strategy};
use remat_engine::{AdamWConfig, MemoryPool};

use super::train::Args;
use summary::Totals;

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
    /// under BYTES, evicting the oldest), auto (per stage and micro-batch, keep what the
    /// stage's --memory-budget leaves room for, measured as it runs). Only with --stages.
    #[arg(long, default_value = "store-all", value_parser = parse_strategy, requires = "stages")]
    pub stage_policy: Strategy,
    /// Data-parallel pipeline replicas: each takes an equal share of --batch and the
    /// gradients are summed over replicas in replica order. Under mpirun, the ranks divided
    /// by --stages (give it to check); in one process, the replicas run one after another.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=64), requires = "stages")]
    pub replicas: Option<u64>,
}

impl PipelineArgs {
    /// --replicas, 1 when not given.
    pub fn replica_count(&self) -> usize {
        self.replicas.map_or(1, |r| r as usize)
    }
}

/// Checks that --batch splits into `replicas` shares of --micro-batches micro-batches.
pub fn check_replicas(args: &Args, replicas: usize) -> anyhow::Result<()> {
    let m = args.pipeline.micro_batches;
    anyhow::ensure!(
        args.batch.is_multiple_of(m * replicas),
        "--batch {} must split evenly into {replicas} replica(s) x --micro-batches {m}",
        args.batch
    );
    Ok(())
}

fn parse_schedule(s: &str) -> Result<Schedule, String> {
    s.parse()
        .map_err(|e: remat_engine::pipeline::schedule::ScheduleError| e.to_string())
}

/// The engine's stage policy parser: `memory:BYTES` reads BYTES with `remat_units`, as
/// `--memory-budget` does, so the two flags accept the same sizes.
pub(crate) fn parse_strategy(s: &str) -> Result<Strategy, String> {
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
        args.files.swap_dir.is_none(),
        "--swap-dir is for --policy auto (single-stage training), not with --stages: pipeline stages keep or recompute activations by --stage-policy and never swap"
    );
    Ok(())
}

/// Runs pipelined training; called by `remat train` when `--stages` is given. Under
/// `mpirun` (a build with the `mpi` feature) each rank runs one stage; otherwise every stage
/// is a thread of this process.
pub fn run(args: &Args, stages: usize, task: &TaskSource<'_>) -> anyhow::Result<()> {
    // Before --stages sizes anything: it may raise the layer count below.
    check_stages(stages)?;
    let launch = launch::detect()?;
    let quiet = launch.is_some_and(|l| l.rank != 0);
    // Every stage needs a block: without --layers, the default depth grows to the stages.
    let mut raised = args.clone();
    if args.layers.is_none() && stages > args.layers() {
        raised.layers = Some(stages);
        if !quiet {
            println!(
                "--stages {stages} needs at least {stages} blocks: using --layers {stages} (the default is {}; give --layers to choose)",
                args.layers()
            );
        }
    }
    let args = &raised;
    check_flags(args, stages)?;
    if let Some(path) = &args.files.dump_grads {
        // Before training: a directory or device there would only fail after the step.
        hf::check_target(path).context("--dump-grads")?;
    }
    match launch {
        Some(launch) => launch::run_mpi(args, stages, task, launch),
        None => run_threaded(args, stages, task),
    }
}

/// The settings every stage of a run shares.
pub struct RunPlan {
    pub config: PipelineConfig,
    pub adam: AdamWConfig,
    pub resources: StageResources,
    pub log_every: u64,
}

impl RunPlan {
    pub fn new(args: &Args, stages: usize) -> Self {
        let p = &args.pipeline;
        Self {
            config: PipelineConfig {
                schedule: p.schedule,
                micro_batches: p.micro_batches,
                strategy: p.stage_policy,
            },
            adam: AdamWConfig {
                lr: args.lr.one(),
                ..AdamWConfig::default()
            },
            resources: StageResources {
                threads: (args.threads() / stages).max(1),
                budget: args.memory_budget,
            },
            log_every: args.log_every.unwrap_or((args.steps / 15).max(1)),
        }
    }

    /// The line that opens the run.
    pub fn describe(&self, args: &Args, stages: usize, replicas: usize, how: &str) -> String {
        let p = &args.pipeline;
        let replicas_count = replicas.max(1);
        let replicas = match replicas {
            1 => String::new(),
            r => format!(", {r} data-parallel replicas"),
        };
        format!(
            "pipeline: {stages} stages x {} thread(s) ({how}){replicas}, {} micro-batches of {} sequences, schedule {}, stage policy {}",
            self.resources.threads,
            p.micro_batches,
            args.batch / (p.micro_batches * replicas_count),
            p.schedule,
            p.stage_policy
        )
    }
}

/// The seed of training step `step` (as the threaded pipeline has always used it).
pub fn step_seed(args: &Args, step: u64) -> u64 {
    args.seed.one() ^ step.rotate_left(32)
}

/// Replica `replica`'s micro-batches of a step's batch: the batch is cut into `replicas`
/// contiguous shares, each into `micro_batches` micro-batches.
pub fn replica_micro_batches(
    batch: &Batch,
    replicas: usize,
    replica: usize,
    micro_batches: usize,
) -> anyhow::Result<Arc<[Batch]>> {
    let shares = split_batch(batch, replicas)?;
    let share = shares
        .get(replica)
        .with_context(|| format!("replica {replica} of {replicas} does not exist"))?;
    Ok(Arc::from(split_batch(share, micro_batches)?))
}

fn progress_bar(steps: u64) -> ProgressBar {
    let bar = ProgressBar::new(steps);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} steps {msg} [{elapsed} < {eta}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

/// Every stage a thread of this process; `--replicas R` runs the data-parallel replicas one
/// after another and sums their gradients in replica order, as the MPI run's all-reduce does.
fn run_threaded(args: &Args, stages: usize, task: &TaskSource<'_>) -> anyhow::Result<()> {
    let replicas = args.pipeline.replica_count();
    check_replicas(args, replicas)?;
    let plan = RunPlan::new(args, stages);
    let model = build_model(args, args.model_config(task.vocab), true)?;
    let staged = StagedGpt(&model);
    let mut pipeline = Pipeline::new(&staged, stages, plan.resources)?;
    println!("{}", plan.describe(args, stages, replicas, "threads"));
    println!("task: {}", task.description);
    let bar = progress_bar(args.steps);
    let mut totals = Totals::new(stages);
    let started = Instant::now();
    for step in 0..args.steps {
        let batch = (task.batch)(step);
        let mut losses = Vec::new();
        let mut sum = ReplicaSum::default();
        for replica in 0..replicas {
            let micro =
                replica_micro_batches(&batch, replicas, replica, args.pipeline.micro_batches)?;
            let seed = replica_step_seed(step_seed(args, step), replica);
            let report = pipeline
                .step(micro, seed, plan.config)
                .with_context(|| format!("training step {step}, replica {replica}"))?;
            totals.add(&report);
            losses.extend(report.losses);
            sum.add(&pipeline.grads())?;
        }
        sum.write_into(&pipeline.grads())?;
        let loss = mean(&losses);
        if let Some(path) = args.files.dump_grads.as_ref().filter(|_| step == 0) {
            let record = hf::StepRecord {
                batch: &batch,
                loss,
                config: &model.config,
            };
            bar.suspend(|| dump_grads(&pipeline.grads(), &record, path))?;
        }
        pipeline.optimizer_step(plan.adam)?;
        bar.set_message(format!("loss {loss:.4}"));
        if step % plan.log_every == 0 || step + 1 == args.steps {
            // Through suspend, not bar.println: a hidden bar (no terminal) swallows println.
            bar.suspend(|| println!("step {step:>5}  loss {loss:.4}"));
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let layers: Vec<_> = pipeline.stages().iter().map(|s| s.layer_range()).collect();
    let micro = args.pipeline.micro_batches;
    totals.print(&layers, micro, replicas, args.steps, started.elapsed());
    Ok(())
}

/// Mean of the micro-batches' losses (0 for none).
pub fn mean(losses: &[f64]) -> f64 {
    losses.iter().sum::<f64>() / losses.len().max(1) as f64
}

/// Gradients summed over replicas in replica order: the first replica's values, then each
/// next one's added element by element (the order the MPI all-reduce adds them in).
#[derive(Default)]
struct ReplicaSum {
    sums: Vec<Vec<f32>>,
    replicas: usize,
}

impl ReplicaSum {
    fn add(&mut self, grads: &[(String, remat_engine::Tensor)]) -> anyhow::Result<()> {
        if self.replicas == 0 {
            self.sums = grads
                .iter()
                .map(|(_, g)| g.to_vec::<f32>())
                .collect::<Result<_, _>>()?;
        } else {
            for ((_, g), sum) in grads.iter().zip(&mut self.sums) {
                for (acc, v) in sum.iter_mut().zip(g.to_vec::<f32>()?) {
                    *acc += v;
                }
            }
        }
        self.replicas += 1;
        Ok(())
    }

    /// Overwrites `grads` with the sum (nothing to do for one replica).
    fn write_into(&self, grads: &[(String, remat_engine::Tensor)]) -> anyhow::Result<()> {
        if self.replicas <= 1 {
            return Ok(());
        }
        for ((_, g), sum) in grads.iter().zip(&self.sums) {
            g.write().as_mut_slice::<f32>()?.copy_from_slice(sum);
        }
        Ok(())
    }
}

/// The GPT every stage copies its parameters from: initialised from the seed as in
/// single-stage training, or loaded from --init, so the runs compare bit for bit.
pub fn build_model(args: &Args, config: GptConfig, announce: bool) -> anyhow::Result<Gpt> {
    let model = Gpt::new(&MemoryPool::unbounded(), config).context("building the GPT")?;
    if let Some(path) = &args.files.init {
        hf::load_params(&model, path).context("--init")?;
        if announce {
            println!("loaded parameters from {}", path.display());
        }
    }
    Ok(model)
}

/// Writes the first step's gradients, gathered from every stage in model order, with the
/// step's whole batch and its mean micro-batch loss (the file format of single-stage
/// `--dump-grads`, written to a temporary name and renamed).
pub fn dump_grads(
    grads: &[(String, remat_engine::Tensor)],
    record: &hf::StepRecord<'_>,
    path: &std::path::Path,
) -> anyhow::Result<()> {
    hf::save_step(path, grads, record).context("--dump-grads")?;
    println!(
        "wrote the first step's gradients ({} tensors) and its batch and loss to {}",
        grads.len(),
        path.display()
    );
    Ok(())
}
