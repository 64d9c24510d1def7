//! `remat train`: trains the GPT of `remat_engine::models::gpt` on the embedded
//! sequence-reversal task (or `--data FILE`, character-level) under a checkpointing policy
//! and a memory budget; `--compare` runs every policy side by side.
//!
//! Layout: flags here; the data in `train/task.rs`; the training loop and its summary in
//! `train/session.rs`; `--compare` in `train/compare.rs`; the out-of-memory hint in
//! `train/hint.rs`. Flags added by later features should dispatch to their own modules.

mod compare;
mod hint;
mod session;
pub mod table;
pub mod task;

use std::path::PathBuf;

use remat_engine::models::gpt::{Checkpointing, GptConfig};

use super::train_multi::per_model::PerModel;

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    #[command(flatten)]
    pub files: Box<FileArgs>,
    /// Spec-driven Qwen3 blocks (`--block`, `--spec`, `--mode`): see `train_spec.rs`.
    #[command(flatten)]
    pub spec_args: Box<super::train_spec::SpecArgs>,
    /// Digits per sequence of the reversal task (sequence length 2 x digits).
    #[arg(long, default_value_t = 12)]
    pub digits: usize,
    /// Sequence length for --data.
    #[arg(long, default_value_t = 64)]
    pub seq: usize,
    /// Transformer blocks (default 2; with --stages P > 2 and no --layers, P).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Model width (with --models: one width for all, or a comma list, one per model).
    #[arg(long, default_value = "64", value_parser = super::train_multi::per_model::parse_widths)]
    pub d_model: PerModel<usize>,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// Key/value heads (grouped-query attention; divides --heads). Default: --heads.
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// SwiGLU hidden width. Default: 8/3 x d_model rounded up to a multiple of 16.
    #[arg(long)]
    pub ffn: Option<usize>,
    /// Residual dropout probability (with --models: one for all, or a comma list).
    #[arg(long, default_value = "0", value_parser = super::train_multi::per_model::parse_dropouts)]
    pub dropout: PerModel<f32>,
    /// Sequences per step.
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Checkpointing: store-all, recompute-all, every:N, depth:N, sqrt (node segments),
    /// per-block, blocks:N, sqrt-blocks; or auto or auto:STRATEGY (profile, plan for
    /// --memory-budget, execute the plan: see `train_auto`).
    #[arg(long, default_value = "store-all", value_parser = super::train_auto::parse_policy_choice)]
    pub policy: super::train_auto::PolicyChoice,
    /// Byte budget of the memory pool (parameters, gradients, optimizer state,
    /// activations, temporaries), e.g. 256MiB, 2GiB, 1.5GB, 1048576 (GB = 10^9 bytes, GiB =
    /// 2^30, units in any case; no fraction: nothing is measured before the budget holds).
    // Hyphen values reach the parser, which says "negative" rather than clap's
    // "unexpected argument '-5'".
    #[arg(long, value_parser = super::units::train_budget_arg, allow_hyphen_values = true)]
    pub memory_budget: Option<u64>,
    /// Training steps.
    #[arg(long, default_value_t = 800)]
    pub steps: u64,
    /// AdamW learning rate, in (0, 1] (with --models: one for all, or a comma list).
    #[arg(long, default_value = "0.003", value_parser = parse_lrs, allow_negative_numbers = true)]
    pub lr: PerModel<f64>,
    /// Seed of the initialization, the data and dropout (with --models: one for all, or a
    /// comma list).
    #[arg(long, default_value = "0", value_parser = super::train_multi::per_model::parse_seeds)]
    pub seed: PerModel<u64>,
    /// Train K models together in one step, sharing the pool and --memory-budget, each
    /// with its own parameters, optimizer, data order and hyper-parameters (see
    /// `train_multi`).
    #[arg(long)]
    pub models: Option<usize>,
    /// With --models: run the K models' ops one after another instead of fusing the ops
    /// of same-shape models into one call each (horizontal fusion, the default).
    #[arg(long)]
    pub no_fuse: bool,
    /// With --models: at most N models per fused unit (MuTWO's fused groups: under
    /// `--policy auto:multiplexed` the groups' steps are interleaved, so one group's swaps
    /// hide behind another group's compute).
    #[arg(long, value_name = "N")]
    pub fuse_width: Option<usize>,
    /// Worker threads (gradients are bit-exact for a given thread count).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Print the loss every N steps, N >= 1 (default: about 15 lines per run).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub log_every: Option<u64>,
    /// Run a few steps under every policy and print one comparison table.
    #[arg(long)]
    pub compare: bool,
    /// Steps per policy for --compare.
    #[arg(long, default_value_t = 3)]
    pub compare_steps: u64,
    /// Pipelined training: --stages, --micro-batches, --schedule, --stage-policy.
    #[command(flatten)]
    pub pipeline: super::train_pipeline::PipelineArgs,
}

/// Files read or written (boxed: paths are large and `Args` sits in the CLI's enum).
#[derive(clap::Args, Debug, Clone)]
pub struct FileArgs {
    /// Train character-level on this text file instead of the embedded reversal task.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Load the parameters from a safetensors file (Hugging Face Llama/Qwen names and
    /// layouts; see `remat_engine::models::gpt::hf`).
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// Write the gradients of the first step to a safetensors file (same names/layouts).
    #[arg(long)]
    pub dump_grads: Option<PathBuf>,
    /// With --policy auto: keep swapped activations in a memory-mapped file in this
    /// directory instead of in memory.
    #[arg(long)]
    pub swap_dir: Option<PathBuf>,
}

pub(crate) fn parse_policy(s: &str) -> Result<Checkpointing, String> {
    s.parse()
        .map_err(|e: remat_engine::EngineError| e.to_string())
}

/// A learning rate: finite, > 0 and at most [`remat_engine::optim::MAX_LR`] (NaN, a
/// negative or an overflowing rate would train to a NaN loss and exit successfully).
fn parse_lr(s: &str) -> Result<f64, String> {
    let lr: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number"))?;
    let max = remat_engine::optim::MAX_LR;
    if lr.is_finite() && lr > 0.0 && lr <= max {
        Ok(lr)
    } else {
        Err(format!(
            "learning rate {s} is out of range: it must be a number in (0, {max}]"
        ))
    }
}

fn parse_lrs(s: &str) -> Result<PerModel<f64>, String> {
    super::train_multi::per_model::parse_list(s, parse_lr)
}

impl Args {
    pub fn threads(&self) -> usize {
        self.threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
            .max(1)
    }

    pub fn checkpointing(&self) -> anyhow::Result<Checkpointing> {
        self.policy.fixed()
    }

    pub fn budget(&self) -> anyhow::Result<Option<u64>> {
        Ok(self.memory_budget)
    }

    /// Transformer blocks: --layers, else 2.
    pub fn layers(&self) -> usize {
        self.layers.unwrap_or(2)
    }

    /// The model configuration for a task of `vocab` tokens.
    pub fn model_config(&self, vocab: usize) -> GptConfig {
        let d = self.d_model.one();
        GptConfig {
            vocab,
            d_model: d,
            n_layers: self.layers(),
            n_heads: self.heads,
            n_kv_heads: self.kv_heads.unwrap_or(self.heads),
            ffn_hidden: self.ffn.unwrap_or((8 * d).div_ceil(3).div_ceil(16) * 16),
            rope_theta: 10000.0,
            norm_eps: 1e-5,
            dropout: self.dropout.one(),
            init_seed: self.seed.one(),
        }
    }

    fn task(&self) -> anyhow::Result<task::Task> {
        anyhow::ensure!(self.batch >= 1, "--batch must be at least 1 (got 0)");
        let task = match &self.files.data {
            Some(path) => task::Task::chars(path, self.seq)?,
            None => task::Task::reverse(self.digits)?,
        };
        task.check_batch(self.batch, self.memory_budget)?;
        Ok(task)
    }
}

/// Refuses flags the fixed-policy GPT loops (`session`, `--compare`) would silently ignore.
fn check_gpt_flags(args: &Args) -> anyhow::Result<()> {
    if args.files.swap_dir.is_some() {
        anyhow::bail!(
            "--swap-dir is only used with --policy auto (which swaps activations); \
             a fixed --policy never swaps: drop --swap-dir or use --policy auto"
        );
    }
    if args.spec_args.mode != remat_engine::spec::compile::Mode::Full {
        anyhow::bail!(
            "--mode {} trains a spec-driven block: it needs --block (or --spec); \
             the built-in GPT always trains every weight",
            args.spec_args.mode.name()
        );
    }
    if !args.compare {
        return Ok(());
    }
    if args.files.dump_grads.is_some() {
        anyhow::bail!(
            "--dump-grads cannot be combined with --compare: --compare runs every policy and \
             writes no file (drop --compare to dump the first step's gradients)"
        );
    }
    let wanted = args.checkpointing()?;
    let default = Checkpointing::Graph(remat_engine::Policy::StoreAll);
    if wanted != default && Checkpointing::all().contains(&wanted) {
        anyhow::bail!(
            "--policy {wanted} has no effect with --compare, which already runs every built-in \
             policy ({}); drop --policy, or give one outside that list (e.g. every:2) to add \
             it as a row",
            Checkpointing::all()
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(())
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let task = args.task()?;
    if let Some(models) = args.models {
        return super::train_multi::run(&args, &task, models);
    }
    anyhow::ensure!(
        args.fuse_width.is_none(),
        "--fuse-width needs --models K: it caps how many of K models trained together are \
         fused into one unit (drop --fuse-width, or give --models)"
    );
    anyhow::ensure!(
        !args.no_fuse,
        "--no-fuse needs --models K: it runs the ops of K models trained together one \
         after another instead of fused (drop --no-fuse, or give --models)"
    );
    args.lr.check_single("--lr")?;
    args.seed.check_single("--seed")?;
    args.dropout.check_single("--dropout")?;
    args.d_model.check_single("--d-model")?;
    // Before --policy auto: the spec path refuses the flags it does not use.
    if args.spec_args.block.is_some() || args.spec_args.spec.is_some() {
        return super::train_spec::run(&args, &task);
    }
    if let super::train_auto::PolicyChoice::Auto(strategy) = &args.policy {
        super::train_auto::check_flags(&args)?;
        return super::train_auto::run(&args, &task, strategy.clone());
    }
    if let Some(stages) = args.pipeline.stages {
        let batch = |step| task.batch(args.seed.one(), step, args.batch);
        let source = super::train_pipeline::TaskSource {
            vocab: task.vocab(),
            description: task.describe(),
            batch: &batch,
        };
        return super::train_pipeline::run(&args, stages, &source);
    }
    check_gpt_flags(&args)?;
    if args.compare {
        compare::run(&args, &task)
    } else {
        session::run(&args, &task)
    }
}
