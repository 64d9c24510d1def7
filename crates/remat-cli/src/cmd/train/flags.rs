//! The flags of `remat train`, every mode's: the shared ones, `--policy` (a fixed policy or
//! `auto[:STRATEGY]`), the per-model lists of `--models K`, the spec-driven blocks' and the
//! pipeline's. The modes (`session`, `compare`, `auto`, `multi`, `pipeline`, `spec`) read
//! them from here and never from each other.

use std::path::PathBuf;

use remat_engine::models::gpt::{Checkpointing, GptConfig};
use remat_engine::pipeline::{Schedule, Strategy};
use remat_engine::session::task::Task;
use remat_engine::spec::Mode;

use super::per_model::{self, PerModel};

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    #[command(flatten)]
    pub files: Box<FileArgs>,
    /// Spec-driven Qwen3 blocks (`--block`, `--spec`, `--mode`): see `train/spec.rs`.
    #[command(flatten)]
    pub spec_args: Box<SpecArgs>,
    /// Digits per sequence of the reversal task (sequence length 2 x digits).
    #[arg(long, default_value = "12", value_parser = crate::units::count_arg::<usize>, allow_hyphen_values = true)]
    pub digits: usize,
    /// Sequence length for --data.
    #[arg(long, default_value = "64", value_parser = crate::units::count_arg::<usize>, allow_hyphen_values = true)]
    pub seq: usize,
    /// Transformer blocks (default 2; with --stages P > 2 and no --layers, P).
    #[arg(long, value_parser = crate::units::count_arg::<usize>, allow_hyphen_values = true)]
    pub layers: Option<usize>,
    /// Model width (with --models: one width for all, or a comma list, one per model).
    #[arg(long, default_value = "64", value_parser = per_model::parse_widths, allow_hyphen_values = true)]
    pub d_model: PerModel<usize>,
    /// Attention heads.
    #[arg(long, default_value = "4", value_parser = crate::units::count_arg::<usize>, allow_hyphen_values = true)]
    pub heads: usize,
    /// Key/value heads (grouped-query attention; divides --heads). Default: --heads.
    #[arg(long, value_parser = crate::units::count_arg::<usize>, allow_hyphen_values = true)]
    pub kv_heads: Option<usize>,
    /// SwiGLU hidden width. Default: 8/3 x d_model rounded up to a multiple of 16.
    #[arg(long, value_parser = crate::units::count_arg::<usize>, allow_hyphen_values = true)]
    pub ffn: Option<usize>,
    /// Residual dropout probability (with --models: one for all, or a comma list).
    #[arg(long, default_value = "0", value_parser = per_model::parse_dropouts, allow_hyphen_values = true)]
    pub dropout: PerModel<f32>,
    /// Sequences per step.
    #[arg(long, default_value = "32", value_parser = crate::units::count_arg::<usize>, allow_hyphen_values = true)]
    pub batch: usize,
    /// Checkpointing: store-all, recompute-all, every:N, depth:N, sqrt (node segments),
    /// per-block, blocks:N, sqrt-blocks; or auto or auto:STRATEGY (profile, plan for
    /// --memory-budget, execute the plan: see `train/auto.rs`).
    #[arg(long, default_value = "store-all", value_parser = parse_policy_choice)]
    pub policy: PolicyChoice,
    /// Byte budget of the memory pool (parameters, gradients, optimizer state,
    /// activations, temporaries), e.g. 256MiB, 2GiB, 1.5GB, 1048576 (GB = 10^9 bytes, GiB =
    /// 2^30, units in any case; no fraction: nothing is measured before the budget holds).
    // Hyphen values reach the parser, which says "negative" rather than clap's
    // "unexpected argument '-5'".
    #[arg(long, value_parser = crate::units::train_budget_arg, allow_hyphen_values = true)]
    pub memory_budget: Option<u64>,
    /// Training steps.
    #[arg(long, default_value = "800", value_parser = crate::units::count_arg::<u64>, allow_hyphen_values = true)]
    pub steps: u64,
    /// AdamW learning rate, in (0, 1] (with --models: one for all, or a comma list).
    #[arg(long, default_value = "0.003", value_parser = parse_lrs, allow_hyphen_values = true)]
    pub lr: PerModel<f64>,
    /// Seed of the initialization, the data and dropout (with --models: one for all, or a
    /// comma list).
    #[arg(long, default_value = "0", value_parser = per_model::parse_seeds, allow_hyphen_values = true)]
    pub seed: PerModel<u64>,
    /// Train K models together in one step, sharing the pool and --memory-budget, each
    /// with its own parameters, optimizer, data order and hyper-parameters (see
    /// `train/multi.rs`).
    #[arg(long, value_parser = crate::units::count_arg::<usize>, allow_hyphen_values = true)]
    pub models: Option<usize>,
    /// With --models: run the K models' ops one after another instead of fusing the ops
    /// of same-shape models into one call each (horizontal fusion, the default).
    #[arg(long)]
    pub no_fuse: bool,
    /// With --models: at most N models per fused unit (MuTWO's fused groups: under
    /// `--policy auto:multiplexed` the groups' steps are interleaved, so one group's swaps
    /// hide behind another group's compute).
    #[arg(long, value_name = "N", value_parser = crate::units::count_arg::<usize>, allow_hyphen_values = true)]
    pub fuse_width: Option<usize>,
    /// Worker threads (gradients are bit-exact for a given thread count).
    #[arg(long, value_parser = crate::units::count_arg::<usize>, allow_hyphen_values = true)]
    pub threads: Option<usize>,
    /// Print the loss every N steps, N >= 1 (default: about 15 lines per run).
    #[arg(long, value_parser = crate::units::count_arg::<u64>, allow_hyphen_values = true)]
    pub log_every: Option<u64>,
    /// Run a few steps under every policy and print one comparison table.
    #[arg(long)]
    pub compare: bool,
    /// Steps per policy for --compare.
    #[arg(long, default_value = "3", value_parser = crate::units::count_arg::<u64>, allow_hyphen_values = true)]
    pub compare_steps: u64,
    /// Pipelined training: --stages, --micro-batches, --schedule, --stage-policy.
    #[command(flatten)]
    pub pipeline: PipelineArgs,
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

pub fn parse_policy(s: &str) -> Result<Checkpointing, String> {
    s.parse()
        .map_err(|e: remat_engine::EngineError| e.to_string())
}

/// A learning rate: finite, > 0 and at most [`remat_engine::core::optim::MAX_LR`] (NaN, a
/// negative or an overflowing rate would train to a NaN loss and exit successfully).
fn parse_lr(s: &str) -> Result<f64, String> {
    let lr: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number"))?;
    let max = remat_engine::core::optim::MAX_LR;
    if lr.is_finite() && lr > 0.0 && lr <= max {
        Ok(lr)
    } else {
        Err(format!(
            "learning rate {s} is out of range: it must be a number in (0, {max}]"
        ))
    }
}

fn parse_lrs(s: &str) -> Result<PerModel<f64>, String> {
    per_model::parse_list(s, parse_lr)
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

    /// Refuses model flags that do not make a GPT (`--heads 3` with `--d-model 64`), in
    /// the flags' names, before anything is printed.
    pub fn check_model_flags(&self, vocab: usize) -> anyhow::Result<()> {
        let c = self.model_config(vocab);
        let heads = c.n_heads;
        if !c.d_model.is_multiple_of(heads) {
            return Err(crate::usage!(
                "--heads {heads}: must divide --d-model {}",
                c.d_model
            ));
        }
        if !heads.is_multiple_of(c.n_kv_heads) {
            return Err(crate::usage!(
                "--kv-heads {}: must divide --heads {heads}",
                c.n_kv_heads
            ));
        }
        let head_dim = c.d_model / heads;
        if !head_dim.is_multiple_of(2) {
            return Err(crate::usage!(
                "--heads {heads}: --d-model {} / --heads {heads} = {head_dim}, a head's width, must be even (rotary embedding)",
                c.d_model
            ));
        }
        c.validate().map_err(|e| {
            crate::usage!("the model flags (--d-model, --heads, --layers, --ffn, --dropout): {e}")
        })
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

    pub fn task(&self) -> anyhow::Result<Task> {
        let task = match &self.files.data {
            Some(path) => Task::chars(path, self.seq)?,
            None => Task::reverse(self.digits)?,
        };
        task.check_batch(self.batch, self.memory_budget)?;
        Ok(task)
    }
}

/// The first of the flags that neither `--policy auto` nor `--models` uses that is set
/// (the spec runtime's, pipeline stages, `--compare`, `--dump-grads`), then of `more`
/// (flag, whether set).
pub fn first_unused_flag(args: &Args, more: &[(&'static str, bool)]) -> Option<&'static str> {
    [
        ("--block", args.spec_args.block.is_some()),
        ("--spec", args.spec_args.spec.is_some()),
        ("--stages", args.pipeline.stages.is_some()),
        ("--compare", args.compare),
        ("--dump-grads", args.files.dump_grads.is_some()),
    ]
    .iter()
    .chain(more)
    .find(|(_, set)| *set)
    .map(|(flag, _)| *flag)
}

/// `--policy` of `remat train`: one of the engine's fixed policies, or `auto[:STRATEGY]`.
#[derive(Clone, Debug, PartialEq)]
pub enum PolicyChoice {
    Fixed(Checkpointing),
    /// Profile, plan with this strategy (all of them when `None`), execute.
    Auto(Option<String>),
}

impl PolicyChoice {
    /// The fixed policy, or an error for `auto` (which has its own training loop).
    pub fn fixed(&self) -> anyhow::Result<Checkpointing> {
        match self {
            PolicyChoice::Fixed(c) => Ok(*c),
            PolicyChoice::Auto(_) => anyhow::bail!(
                "--policy auto runs its own training loop and cannot be combined with --compare"
            ),
        }
    }
}

pub fn parse_policy_choice(s: &str) -> Result<PolicyChoice, String> {
    match s.strip_prefix("auto") {
        Some("") => Ok(PolicyChoice::Auto(None)),
        Some(rest) => match rest.strip_prefix(':') {
            Some(name) if !name.is_empty() => Ok(PolicyChoice::Auto(Some(name.to_string()))),
            _ => Err(format!(
                "policy {s:?}: expected auto or auto:STRATEGY (a `remat plan` strategy name)"
            )),
        },
        None => parse_policy(s).map(PolicyChoice::Fixed),
    }
}

/// Flags of spec-driven training (flattened into `remat train`).
#[derive(clap::Args, Debug, Clone)]
pub struct SpecArgs {
    /// Train a spec-driven block instead of the GPT: qwen3, qwen3-moe or mamba (default:
    /// the block --spec names, else qwen3).
    #[arg(long)]
    pub block: Option<String>,
    /// Recompute spec (default: the shipped spec of --block).
    #[arg(long)]
    pub spec: Option<PathBuf>,
    /// Model config for --block (default: the shipped example config; vocab_size, batch and
    /// seq_len come from the task).
    #[arg(long)]
    pub block_config: Option<PathBuf>,
    /// Override a --block config value: KEY=VALUE (repeatable).
    #[arg(long = "block-set", value_name = "KEY=VALUE")]
    pub block_set: Vec<String>,
    /// full (every weight) or lora (adapters on q, k, v, o, gate, up, down; Mamba: on
    /// in_proj, x_proj, out_proj).
    #[arg(long, default_value = "full")]
    pub mode: Mode,
    /// LoRA rank, alpha and dropout.
    #[arg(long, default_value = "8", value_parser = crate::units::count_arg::<usize>, allow_hyphen_values = true)]
    pub lora_rank: usize,
    #[arg(long, default_value_t = 16.0, allow_hyphen_values = true)]
    pub lora_alpha: f32,
    #[arg(long, default_value_t = 0.05, allow_hyphen_values = true)]
    pub lora_dropout: f64,
}

/// The pipeline flags of `remat train`.
#[derive(clap::Args, Debug, Clone)]
pub struct PipelineArgs {
    /// Train pipelined over this many stages (each its own thread and memory pool; the
    /// --memory-budget applies to each stage).
    #[arg(long, value_parser = crate::units::count_arg::<usize>, allow_hyphen_values = true)]
    pub stages: Option<usize>,
    /// Micro-batches per step (they split --batch evenly). Only with --stages.
    #[arg(long, default_value = "8", requires = "stages", value_parser = crate::units::count_arg::<usize>, allow_hyphen_values = true)]
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
    #[arg(long, value_parser = parse_replicas, requires = "stages", allow_hyphen_values = true)]
    pub replicas: Option<u64>,
}

impl PipelineArgs {
    /// --replicas, 1 when not given.
    pub fn replica_count(&self) -> usize {
        self.replicas.map_or(1, |r| r as usize)
    }
}

/// Data-parallel replicas: 1 to 64.
fn parse_replicas(s: &str) -> Result<u64, String> {
    let n: u64 = crate::units::count_arg(s)?;
    if n > 64 {
        return Err("must be at most 64".to_string());
    }
    Ok(n)
}

fn parse_schedule(s: &str) -> Result<Schedule, String> {
    s.parse()
        .map_err(|e: remat_engine::pipeline::schedule::ScheduleError| e.to_string())
}

/// The engine's stage policy parser: `memory:BYTES` reads BYTES with `remat_units`, as
/// `--memory-budget` does, so the two flags accept the same sizes.
fn parse_strategy(s: &str) -> Result<Strategy, String> {
    s.parse()
        .map_err(|e: remat_engine::pipeline::manager::StrategyParseError| e.to_string())
}
