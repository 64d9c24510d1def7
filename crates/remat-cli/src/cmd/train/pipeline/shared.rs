//! What the threaded and the MPI pipelined runs share: where the batches come from, the
//! settings every stage shares, the model every stage copies, the seeds, the
//! micro-batches of a replica and the gradient dump.

use std::sync::Arc;

use anyhow::Context;
use remat_engine::models::gpt::{Batch, Gpt, GptConfig, hf};
use remat_engine::pipeline::PipelineConfig;
use remat_engine::pipeline::driver::StageResources;
use remat_engine::pipeline::staged_gpt::split_batch;
use remat_engine::{AdamWConfig, MemoryPool};

use super::super::flags::Args;

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

/// Where the training batches come from (the task lives with `remat train`).
pub struct TaskSource<'a> {
    pub vocab: usize,
    pub description: String,
    /// Batch of step `step` (deterministic in the seed).
    pub batch: &'a dyn Fn(u64) -> Batch,
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

/// Mean of the micro-batches' losses (0 for none).
pub fn mean(losses: &[f64]) -> f64 {
    losses.iter().sum::<f64>() / losses.len().max(1) as f64
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
