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
mod shared;
mod summary;

use std::time::Instant;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use remat_engine::models::gpt::hf;
use remat_engine::pipeline::driver::{Pipeline, replica_step_seed};
use remat_engine::pipeline::limits::{MAX_STAGES, check_micro_batches};
use remat_engine::pipeline::staged_gpt::StagedGpt;

use super::flags::{Args, PolicyChoice, parse_policy};
use shared::{
    RunPlan, build_model, check_replicas, dump_grads, mean, replica_micro_batches, step_seed,
};
use summary::Totals;

pub use shared::TaskSource;

/// Checks --stages alone, before it is used to size anything (it may raise --layers).
fn check_stages(stages: usize) -> anyhow::Result<()> {
    anyhow::ensure!(stages >= 1, "--stages must be at least 1");
    anyhow::ensure!(
        stages <= MAX_STAGES,
        "--stages {stages} is more than remat runs ({MAX_STAGES}): each stage is a thread with its own memory pool"
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
    let store_all = PolicyChoice::Fixed(parse_policy("store-all").map_err(anyhow::Error::msg)?);
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
        Some(launch) => run_mpi(args, stages, task, launch),
        None => run_threaded(args, stages, task),
    }
}

/// Runs this rank's stage of an MPI-launched run.
fn run_mpi(
    args: &Args,
    stages: usize,
    task: &TaskSource<'_>,
    launch: launch::Launch,
) -> anyhow::Result<()> {
    #[cfg(feature = "mpi")]
    {
        mpi_run::run(args, stages, task, launch)
    }
    #[cfg(not(feature = "mpi"))]
    {
        let _ = (args, stages, task, launch);
        anyhow::bail!(launch::NOT_BUILT)
    }
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
