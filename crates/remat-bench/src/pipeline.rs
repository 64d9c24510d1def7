//! `remat bench pipeline`: a GPT split over P stages (default 4), for M = 4, 8, 16
//! micro-batches, under both schedules and every stage policy: per-stage peak activation
//! memory and busy time, and step time as ratios to GPipe + store-all at the same M, and the measured
//! bubble fraction against the ideal (P-1)/(M+P-1), all measured in one run.
//!
//! Stages are threads: on a machine with fewer cores than stages they time-share cores, which
//! stretches busy times and so understates the bubble; the ideal column is the reference.

use std::sync::Arc;

use indicatif::ProgressBar;
use remat_engine::core::kernels::philox_hash;
use remat_engine::models::gpt::{Batch, Gpt, GptConfig};
use remat_engine::pipeline::driver::{Pipeline, StageResources, StepReport};
use remat_engine::pipeline::staged_gpt::{StagedGpt, split_batch};
use remat_engine::pipeline::{PipelineConfig, Schedule, Strategy};
use remat_engine::{Category, MemoryPool};
use remat_report::{Layout, render};
use remat_units::{exact_bytes, human_bytes};

use crate::error::{Result, bail, ensure, failed};

#[derive(clap::Args)]
pub struct Args {
    /// Pipeline stages.
    #[arg(long, default_value_t = 4, value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    stages: usize,
    /// Micro-batch counts to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "4,8,16", value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    micro_batches: Vec<usize>,
    /// Transformer blocks (split evenly over the stages).
    #[arg(long, default_value_t = 8, value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    layers: usize,
    /// Model width.
    #[arg(long, default_value_t = 128, value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    d_model: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4, value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    heads: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 64, value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    seq: usize,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 2, value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    rows: usize,
    /// Kernel threads per stage.
    #[arg(long, default_value_t = 1, value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    threads_per_stage: usize,
    /// Timed steps per configuration (after a warm-up); the fastest is reported (on a shared
    /// machine, other processes only ever add time).
    #[arg(long, default_value_t = 3, value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    repeats: usize,
    /// threads (every stage a thread of this process: the schedule x stage-policy tables) or
    /// mpi (every stage an MPI rank: step time, bubble and bytes sent for 1, 2 and 4 stages
    /// against threads, through `mpirun`; needs a build with the `mpi` feature).
    #[arg(long, default_value = "threads", value_parser = ["threads", "mpi"])]
    transport: String,
}

/// One configuration's measurements.
struct Measured {
    schedule: Schedule,
    strategy: Strategy,
    seconds: f64,
    /// Peak activation bytes of each stage.
    peaks: Vec<u64>,
    /// Busy time of each stage in the step (its forwards, backwards and recomputes).
    busy: Vec<f64>,
    bubble: f64,
    recomputes: usize,
    /// The most bytes of forward states the busiest stage's checkpoint manager held.
    peak_stored_bytes: usize,
    /// The highest pool peak (everything the stage held) over the stages.
    max_total_peak: u64,
    /// The per-stage budget it ran under (auto), if any.
    budget: Option<u64>,
}

impl Measured {
    fn max_peak(&self) -> u64 {
        self.peaks.iter().copied().max().unwrap_or(0)
    }
}

fn model_config(args: &Args) -> GptConfig {
    GptConfig {
        vocab: 256,
        d_model: args.d_model,
        n_layers: args.layers,
        n_heads: args.heads,
        n_kv_heads: args.heads,
        ffn_hidden: 4 * args.d_model,
        rope_theta: 10000.0,
        norm_eps: 1e-5,
        dropout: 0.0,
        init_seed: 0,
    }
}

/// The most kernel threads a stage may ask for: every stage spawns its own pool of them.
const MAX_THREADS_PER_STAGE: usize = 256;

/// The most tokens one step's batch may hold (rows x micro-batches x seq).
const MAX_BATCH_TOKENS: usize = 1 << 24;

/// Every flag checked before the model is built or a thread started.
fn check_args(args: &Args) -> Result<()> {
    use remat_engine::pipeline::limits::{MAX_STAGES, check_micro_batches};
    ensure!(
        (1..=MAX_STAGES).contains(&args.stages),
        "--stages {} must be between 1 and {MAX_STAGES}",
        args.stages
    );
    ensure!(
        args.stages <= args.layers,
        "--stages {} exceeds --layers {}: every stage needs at least one block",
        args.stages,
        args.layers
    );
    ensure!(!args.micro_batches.is_empty(), "--micro-batches is empty");
    for &m in &args.micro_batches {
        check_micro_batches(m)?;
        tokens(args, m)?;
    }
    ensure!(
        (1..=MAX_THREADS_PER_STAGE).contains(&args.threads_per_stage),
        "--threads-per-stage {} must be between 1 and {MAX_THREADS_PER_STAGE}",
        args.threads_per_stage
    );
    ensure!(args.rows >= 1, "--rows must be at least 1");
    ensure!(args.seq >= 1, "--seq must be at least 1");
    Ok(())
}

/// Tokens of a step's batch at `micro_batches`, refused past [`MAX_BATCH_TOKENS`].
fn tokens(args: &Args, micro_batches: usize) -> Result<usize> {
    args.rows
        .checked_mul(micro_batches)
        .and_then(|rows| rows.checked_mul(args.seq))
        .filter(|&n| n <= MAX_BATCH_TOKENS)
        .ok_or_else(|| {
            failed!(
                "--rows {} x --micro-batches {micro_batches} x --seq {} is more than {MAX_BATCH_TOKENS} tokens per step",
                args.rows,
                args.seq
            )
        })
}

fn batch(args: &Args, micro_batches: usize) -> Result<Batch> {
    let rows = args.rows * micro_batches;
    let n = tokens(args, micro_batches)?;
    let ids = |stream: u64| -> Arc<[u32]> {
        (0..n as u64)
            .map(|i| (philox_hash(stream, i) % 256) as u32)
            .collect()
    };
    Ok(Batch {
        tokens: ids(1),
        targets: ids(2),
        batch: rows,
        seq: args.seq,
    })
}

fn run_once(
    staged: &StagedGpt<'_>,
    args: &Args,
    micro: &Arc<[Batch]>,
    config: PipelineConfig,
    budget: Option<u64>,
) -> Result<Measured> {
    let resources = StageResources {
        threads: args.threads_per_stage,
        budget,
    };
    let mut pipeline = Pipeline::new(staged, args.stages, resources)?;
    let mut reports: Vec<StepReport> = Vec::with_capacity(args.repeats + 1);
    for _ in 0..=args.repeats.max(1) {
        reports.push(pipeline.step(Arc::clone(micro), 0, config)?);
    }
    // The first step warms up (page faults, thread pools); the fastest of the rest counts.
    let Some(fastest) = reports[1..].iter().min_by_key(|r| r.run.wall) else {
        bail!("no timed step ran");
    };
    Ok(Measured {
        schedule: config.schedule,
        strategy: config.strategy,
        seconds: fastest.run.wall.as_secs_f64(),
        peaks: fastest
            .memory
            .iter()
            .map(|m| m.category(Category::Activations).peak)
            .collect(),
        busy: fastest
            .run
            .stages
            .iter()
            .map(|s| s.busy.as_secs_f64())
            .collect(),
        bubble: fastest.run.bubble_fraction(),
        recomputes: fastest
            .run
            .stages
            .iter()
            .map(|s| s.checkpoint.recomputes)
            .sum(),
        peak_stored_bytes: fastest
            .run
            .stages
            .iter()
            .map(|s| s.checkpoint.peak_stored_bytes)
            .max()
            .unwrap_or(0),
        max_total_peak: fastest.memory.iter().map(|m| m.peak).max().unwrap_or(0),
        budget,
    })
}

fn strategies(memory_threshold: usize) -> [Strategy; 5] {
    [
        Strategy::StoreAll,
        Strategy::RecomputeAll,
        Strategy::Selective { interval: 2 },
        Strategy::MemoryBased {
            threshold_bytes: memory_threshold,
        },
        Strategy::Auto,
    ]
}

pub fn run(args: Args) -> Result<()> {
    check_args(&args)?;
    if args.transport == "mpi" {
        return crate::pipeline_mpi::run(&crate::pipeline_mpi::MpiBench {
            layers: args.layers,
            d_model: args.d_model,
            heads: args.heads,
            rows: args.rows,
            repeats: args.repeats,
        });
    }
    let model = Gpt::new(&MemoryPool::unbounded(), model_config(&args))?;
    let staged = StagedGpt(&model);
    println!(
        "GPT L={} d={} heads={} seq={} vocab=256; {} stages x {} thread(s); {} sequences per micro-batch",
        args.layers,
        args.d_model,
        args.heads,
        args.seq,
        args.stages,
        args.threads_per_stage,
        args.rows
    );
    let runs = args.micro_batches.len() * 2 * 5;
    let bar = ProgressBar::new(runs as u64);
    let mut tables = Vec::new();
    for &m in &args.micro_batches {
        let micro: Arc<[Batch]> = split_batch(&batch(&args, m)?, m)?.into();
        let config = |schedule, strategy| PipelineConfig {
            schedule,
            micro_batches: m,
            strategy,
        };
        let baseline = run_once(
            &staged,
            &args,
            &micro,
            config(Schedule::GPipe, Strategy::StoreAll),
            None,
        )?;
        bar.inc(1);
        // Room for the forward states of half as many micro-batches as there are stages.
        let per_state = baseline.peak_stored_bytes / m.max(1);
        let threshold = per_state * (args.stages / 2).max(1);
        let mut rows = Vec::new();
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            let mut measured = Vec::new();
            // auto runs under a per-stage budget: recompute-all's peak plus the room the
            // memory:BYTES row gets; the other rows say whether they would fit it.
            let mut budget = None;
            for strategy in strategies(threshold) {
                let run = match (schedule, strategy) {
                    (Schedule::GPipe, Strategy::StoreAll) => run_clone(&baseline),
                    (_, Strategy::Auto) => {
                        bar.inc(1);
                        run_once(&staged, &args, &micro, config(schedule, strategy), budget)?
                    }
                    _ => {
                        bar.inc(1);
                        run_once(&staged, &args, &micro, config(schedule, strategy), None)?
                    }
                };
                if strategy == Strategy::RecomputeAll {
                    budget = Some(run.max_total_peak + threshold as u64);
                }
                measured.push(run);
            }
            for x in &measured {
                rows.push(row(x, &baseline, args.stages, m, budget));
            }
        }
        tables.push((m, rows));
    }
    bar.finish_and_clear();
    for (m, rows) in tables {
        println!(
            "\nM = {m} micro-batches (ratios against GPipe + store-all at M = {m}; ideal bubble {:.3})",
            remat_engine::pipeline::schedule::ideal_bubble_fraction(args.stages, m)
        );
        let header = [
            "schedule",
            "stage policy",
            "step time",
            "x time",
            "peak act (max stage)",
            "x peak",
            "peak act per stage",
            "busy ms per stage",
            "bubble",
            "bubble / ideal",
            "recomputes",
            "peak (max stage)",
            "fits auto's budget",
        ];
        println!("{}", render(Layout::Aligned, &header, &rows));
    }
    Ok(())
}

fn run_clone(m: &Measured) -> Measured {
    Measured {
        schedule: m.schedule,
        strategy: m.strategy,
        seconds: m.seconds,
        peaks: m.peaks.clone(),
        busy: m.busy.clone(),
        bubble: m.bubble,
        recomputes: m.recomputes,
        peak_stored_bytes: m.peak_stored_bytes,
        max_total_peak: m.max_total_peak,
        budget: m.budget,
    }
}

fn row(x: &Measured, base: &Measured, stages: usize, m: usize, budget: Option<u64>) -> Vec<String> {
    let ideal = remat_engine::pipeline::schedule::ideal_bubble_fraction(stages, m);
    let ratio = |a: f64, b: f64| {
        if b > 0.0 {
            format!("{:.2}", a / b)
        } else {
            "-".into()
        }
    };
    let strategy = match x.strategy {
        Strategy::MemoryBased { threshold_bytes } => {
            format!("memory:{}", exact_bytes(threshold_bytes as u64))
        }
        Strategy::Auto => match x.budget {
            Some(b) => format!("auto (budget {})", exact_bytes(b)),
            None => "auto".into(),
        },
        s => s.to_string(),
    };
    let fits = match (x.strategy, budget) {
        (Strategy::Auto, _) => "ran under it".to_string(),
        (_, Some(b)) if x.max_total_peak <= b => "yes".into(),
        (_, Some(_)) => "no".into(),
        (_, None) => "-".into(),
    };
    vec![
        x.schedule.to_string(),
        strategy,
        format!("{:.3} s", x.seconds),
        ratio(x.seconds, base.seconds),
        human_bytes(x.max_peak()),
        ratio(x.max_peak() as f64, base.max_peak() as f64),
        x.peaks
            .iter()
            .map(|p| format!("{:.1}", *p as f64 / (1 << 20) as f64))
            .collect::<Vec<_>>()
            .join(" / ")
            + " MiB",
        x.busy
            .iter()
            .map(|b| format!("{:.1}", b * 1e3))
            .collect::<Vec<_>>()
            .join(" / "),
        format!("{:.3}", x.bubble),
        ratio(x.bubble, ideal),
        x.recomputes.to_string(),
        human_bytes(x.max_total_peak),
        fits,
    ]
}
