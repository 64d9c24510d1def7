//! `remat bench engine`: one GPT training step (forward + backward, without the optimizer
//! update, as stated in its output) at issue 2's bench size
//! (L=8, d=256, 8 heads, sequence 256, batch 8, vocabulary 256, 2 threads) under store-all,
//! per-block checkpointing and sqrt(L) block segments. Step time and peak activation memory
//! are reported as ratios to store-all measured in the same run, and the step's achieved
//! GFLOP/s against the GFLOP/s of a plain matmul of the model's shapes, also measured here.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use indicatif::ProgressBar;
use remat_engine::core::kernels::philox_hash;
use remat_engine::models::gpt::{Batch, Checkpointing, Gpt, GptConfig};
use remat_engine::{
    Category, ExecContext, Graph, GraphObserver, MemoryPool, NodeEvent, Policy, Tensor,
};
use remat_report::{Layout, render};
use remat_units::human_bytes;

use crate::error::{Result, failed};
use crate::ratio::paired_median;
use crate::torch::TorchPeer;

#[derive(clap::Args)]
pub struct Args {
    /// Worker threads.
    #[arg(long, default_value_t = 2, value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    threads: usize,
    /// Rounds of timed steps, one step of each policy per round (after one warm-up step
    /// each); medians are reported.
    #[arg(long, default_value_t = 5, value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    steps: usize,
    /// Transformer blocks (the bench uses 8).
    #[arg(long, default_value_t = 8, value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    layers: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 8, value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 256, value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    seq: usize,
    /// Also print where one store-all step spends its time, per op kind and phase.
    #[arg(long)]
    profile: bool,
    /// Also time PyTorch's step on the same model (store-all, and torch.utils.checkpoint
    /// per block), alternating with remat's in the same rounds: the Python interpreter to
    /// run (it must import torch), e.g. `python3`.
    #[arg(long, value_name = "PYTHON")]
    torch: Option<String>,
}

/// Sums node execution times per (op kind, phase).
#[derive(Clone, Default)]
struct OpTimes(Arc<Mutex<TimeTable>>);

/// `(op kind, phase) -> (seconds, runs)`.
type TimeTable = BTreeMap<(String, String), (f64, u64)>;

impl GraphObserver for OpTimes {
    fn after_node(&mut self, e: &NodeEvent<'_>) {
        if let Ok(mut m) = self.0.lock() {
            let slot = m
                .entry((e.kind.to_string(), format!("{:?}", e.phase)))
                .or_default();
            slot.0 += e.elapsed.as_secs_f64();
            slot.1 += 1;
        }
    }
}

fn profile(ctx: &ExecContext, gpt: &Gpt, b: &Batch, ckpt: Checkpointing) -> Result<()> {
    let times = OpTimes::default();
    let start = Instant::now();
    gpt.forward_backward_observed(ctx, b, ckpt, 0, Some(Box::new(times.clone())))?;
    let total = start.elapsed().as_secs_f64();
    let map = times
        .0
        .lock()
        .map_err(|_| failed!("profile lock poisoned"))?;
    let mut rows: Vec<_> = map.iter().collect();
    rows.sort_by(|a, b| b.1.0.total_cmp(&a.1.0));
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|((kind, phase), (secs, n))| {
            vec![
                format!("{kind} {phase}"),
                n.to_string(),
                format!("{:.1}", secs * 1e3),
                format!("{:.1}", 100.0 * secs / total),
            ]
        })
        .collect();
    println!("profile of one {ckpt} step ({total:.3} s):");
    print!(
        "{}",
        render(Layout::Aligned, &["op", "runs", "ms", "% of step"], &cells)
    );
    Ok(())
}

/// One row of the bench.
struct Variant<'a> {
    label: String,
    runner: Runner<'a>,
}

/// What runs a row's step.
enum Runner<'a> {
    /// remat under `ckpt` in `ctx`; `elsewhere` is bytes held in another pool for it (the
    /// parameters), added to its peak.
    Engine {
        ckpt: Checkpointing,
        ctx: &'a ExecContext,
        elsewhere: u64,
    },
    /// The PyTorch peer under `policy` (its memory is not measured).
    Torch { policy: &'static str },
}

struct Measured<'a> {
    variant: Variant<'a>,
    /// Median step time.
    seconds: f64,
    /// Median over rounds of this row's step time over the first row's in the same round.
    ratio: f64,
    peak_activations: Option<u64>,
    peak_total: Option<u64>,
    times: Vec<f64>,
}

fn batch(cfg: &GptConfig, batch: usize, seq: usize) -> Batch {
    let n = batch * seq;
    let ids = |stream: u64| -> Arc<[u32]> {
        (0..n as u64)
            .map(|i| (philox_hash(stream, i) % cfg.vocab as u64) as u32)
            .collect()
    };
    Batch {
        tokens: ids(1),
        targets: ids(2),
        batch,
        seq,
    }
}

/// One timed step: (seconds, peak activation bytes, peak total bytes).
fn one_step(
    ctx: &ExecContext,
    gpt: &Gpt,
    b: &Batch,
    ckpt: Checkpointing,
) -> Result<(f64, u64, u64)> {
    ctx.pool().reset_peak();
    let start = Instant::now();
    let out = gpt.forward_backward(ctx, b, ckpt, 0)?;
    let seconds = start.elapsed().as_secs_f64();
    drop(out.grads);
    Ok((
        seconds,
        out.pool.category(Category::Activations).peak,
        out.pool.peak,
    ))
}

/// A pause when the bench switches between remat and the PyTorch peer. Idle worker
/// threads spin before they sleep (OpenMP's by default for up to a few hundred
/// milliseconds, rayon's briefly): without it, the program that just finished would steal
/// cycles from the other's step.
fn settle() {
    std::thread::sleep(std::time::Duration::from_millis(300));
}

/// One step of a row: (seconds, peak activation bytes, peak total bytes) where measured.
fn run_variant(
    v: &Variant<'_>,
    gpt: &Gpt,
    b: &Batch,
    torch: Option<&mut TorchPeer>,
) -> Result<(f64, Option<u64>, Option<u64>)> {
    match v.runner {
        Runner::Engine {
            ckpt,
            ctx,
            elsewhere,
        } => {
            let (t, a, p) = one_step(ctx, gpt, b, ckpt)?;
            Ok((t, Some(a), Some(p + elsewhere)))
        }
        Runner::Torch { policy } => {
            let peer = torch.ok_or_else(|| failed!("no PyTorch peer is running"))?;
            Ok((peer.step(policy)?, None, None))
        }
    }
}

/// Runs the rows in rounds, one step of each per round (after one warm-up step each:
/// page faults, thread start-up), so that every row sees the same machine: on a shared
/// machine the speed drifts over seconds, and timing one row after the other would put
/// that drift into the ratios. The first row is the reference of the ratios.
fn measure_rounds<'a>(
    gpt: &Gpt,
    b: &Batch,
    variants: Vec<Variant<'a>>,
    mut torch: Option<&mut TorchPeer>,
    rounds: usize,
    bar: &ProgressBar,
) -> Result<Vec<Measured<'a>>> {
    let mut rows: Vec<Measured> = Vec::with_capacity(variants.len());
    for variant in variants {
        let (_, peak_activations, peak_total) =
            run_variant(&variant, gpt, b, torch.as_deref_mut())?;
        rows.push(Measured {
            variant,
            seconds: 0.0,
            ratio: 1.0,
            peak_activations,
            peak_total,
            times: Vec::with_capacity(rounds),
        });
    }
    let mut last_was_torch = false;
    for _ in 0..rounds.max(1) {
        for row in &mut rows {
            bar.set_message(row.variant.label.clone());
            let is_torch = matches!(row.variant.runner, Runner::Torch { .. });
            if is_torch != last_was_torch {
                settle();
            }
            last_was_torch = is_torch;
            let (t, a, p) = run_variant(&row.variant, gpt, b, torch.as_deref_mut())?;
            row.times.push(t);
            row.peak_activations = row.peak_activations.max(a);
            row.peak_total = row.peak_total.max(p);
        }
        bar.inc(1);
    }
    let reference = rows.first().map(|r| r.times.clone()).unwrap_or_default();
    for row in &mut rows {
        row.seconds = remat_units::median(&row.times).unwrap_or(0.0);
        row.ratio = paired_median(&row.times, &reference);
    }
    Ok(rows)
}

/// The PyTorch peer's rows, after remat's.
const TORCH_POLICIES: [&str; 2] = ["store-all", "per-block"];

/// remat's step time over PyTorch's for the same policy, as the median of per-round ratios.
fn print_against_torch(rows: &[Measured<'_>]) {
    // remat's own rows are labelled by their policy alone (the row without buffer reuse
    // is not one of them).
    let times = |engine: Checkpointing| {
        rows.iter()
            .find(|r| r.variant.label == engine.to_string())
            .map(|r| &r.times)
    };
    let torch = |policy: &str| {
        rows.iter()
            .find(|r| matches!(r.variant.runner, Runner::Torch { policy: p } if p == policy))
            .map(|r| &r.times)
    };
    let pairs = [
        ("store-all", Checkpointing::Graph(Policy::StoreAll)),
        ("per-block", Checkpointing::PerBlock),
    ];
    let parts: Vec<String> = pairs
        .iter()
        .filter_map(|&(policy, ckpt)| {
            let (ours, theirs) = (times(ckpt)?, torch(policy)?);
            Some(format!("{policy} {:.2}x", paired_median(ours, theirs)))
        })
        .collect();
    println!(
        "remat's step time over PyTorch's, same policy, same rounds (median of per-round ratios; below 1 is faster): {}",
        parts.join(", ")
    );
}

/// GFLOP/s of the engine's matmul on the step's largest shape (tokens x d -> ffn).
fn matmul_gflops(ctx: &ExecContext, cfg: &GptConfig, tokens: usize) -> Result<f64> {
    let pool = ctx.pool();
    let (m, k, n) = (tokens, cfg.d_model, cfg.ffn_hidden);
    let a = Tensor::from_vec(
        pool,
        "a",
        &[m, k],
        vec![0.5f32; m * k],
        Category::Activations,
    )?;
    let w = Tensor::from_vec(
        pool,
        "w",
        &[k, n],
        vec![0.25f32; k * n],
        Category::Parameters,
    )?;
    let mut best = f64::INFINITY;
    for _ in 0..10 {
        let mut g = Graph::new(ctx);
        let (an, wn) = (g.input("a", a.clone()), g.param("w", &w));
        let y = g.matmul(an, wn)?;
        Policy::StoreAll.apply(&mut g)?;
        let start = Instant::now();
        g.forward()?;
        best = best.min(start.elapsed().as_secs_f64());
        drop(g.value(y)?);
    }
    Ok(2.0 * (m * k * n) as f64 / best / 1e9)
}

pub fn run(args: Args) -> Result<()> {
    let cfg = GptConfig {
        n_layers: args.layers,
        ..GptConfig::bench()
    };
    let pool = MemoryPool::unbounded();
    let ctx = ExecContext::new(pool.clone(), args.threads)?;
    let gpt = Gpt::new(&pool, cfg.clone())?;
    let b = batch(&cfg, args.batch, args.seq);
    println!(
        "remat bench engine: GPT L={} d={} heads={} ffn={} vocab={} ({} parameters), batch {} x seq {}, {} threads; a step is forward + backward (no optimizer update), median of {} rounds (one step of each policy per round, after one warm-up step each); x store-all is the median of the per-round ratios",
        cfg.n_layers,
        cfg.d_model,
        cfg.n_heads,
        cfg.ffn_hidden,
        cfg.vocab,
        cfg.param_count(),
        args.batch,
        args.seq,
        args.threads,
        args.steps
    );
    // The same store-all step with a pool that frees every buffer instead of reusing it:
    // what the pool's buffer cache is worth (activations and gradients then come from the
    // second pool; the parameters stay in the first and are added to its peak).
    let uncached_pool = MemoryPool::unbounded();
    uncached_pool.set_buffer_cache(false);
    let uncached = ExecContext::new(uncached_pool, args.threads)?;
    let store_all = Checkpointing::Graph(Policy::StoreAll);
    let mut variants: Vec<Variant> = [
        store_all,
        Checkpointing::PerBlock,
        Checkpointing::SqrtBlocks,
    ]
    .into_iter()
    .map(|ckpt| Variant {
        label: ckpt.to_string(),
        runner: Runner::Engine {
            ckpt,
            ctx: &ctx,
            elsewhere: 0,
        },
    })
    .collect();
    variants.push(Variant {
        label: format!("{store_all}, no buffer reuse"),
        runner: Runner::Engine {
            ckpt: store_all,
            ctx: &uncached,
            elsewhere: pool.live(),
        },
    });
    let bar = ProgressBar::new(args.steps.max(1) as u64 + 1);
    let mut torch = match &args.torch {
        Some(python) => {
            bar.set_message("starting PyTorch");
            let peer = TorchPeer::spawn(python, &cfg, args.batch, args.seq, args.threads)?;
            for policy in TORCH_POLICIES {
                variants.push(Variant {
                    label: format!("PyTorch {} {policy}", peer.version),
                    runner: Runner::Torch { policy },
                });
            }
            Some(peer)
        }
        None => None,
    };
    let rows = measure_rounds(&gpt, &b, variants, torch.as_mut(), args.steps, &bar)?;
    drop(torch);
    let mm = matmul_gflops(&ctx, &cfg, args.batch * args.seq)?;
    bar.finish_and_clear();
    let flops = cfg.step_flops(args.batch, args.seq);
    let base = &rows[0];
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let activations = r.peak_activations.zip(base.peak_activations);
            vec![
                r.variant.label.clone(),
                format!("{:.3}", r.seconds),
                format!("{:.2}", r.ratio),
                r.peak_activations.map_or("-".into(), human_bytes),
                activations.map_or("-".into(), |(a, b)| {
                    format!("{:.3}", a as f64 / b.max(1) as f64)
                }),
                r.peak_total.map_or("-".into(), human_bytes),
                format!("{:.1}", flops / r.seconds / 1e9),
            ]
        })
        .collect();
    let header = [
        "policy",
        "step s",
        "x store-all",
        "peak activations",
        "x store-all",
        "peak total",
        "GFLOP/s",
    ];
    print!("{}", render(Layout::Aligned, &header, &cells));
    println!(
        "step: {:.1} GFLOP (model FLOPs, no recompute); matmul [{} x {}] x [{} x {}]: {:.1} GFLOP/s; store-all step reaches {:.0}% of it",
        flops / 1e9,
        args.batch * args.seq,
        cfg.d_model,
        cfg.d_model,
        cfg.ffn_hidden,
        mm,
        100.0 * flops / base.seconds / 1e9 / mm
    );
    if args.torch.is_some() {
        print_against_torch(&rows);
    }
    println!(
        "reference: PyTorch (2 threads) 0.83 s store-all, 1.04 s per-block. goals: store-all < 0.83 s; per-block <= 1.3x store-all; per-block activations <= 1/L + one block = {:.3} of store-all",
        2.0 / cfg.n_layers as f64
    );
    if args.profile {
        profile(&ctx, &gpt, &b, Checkpointing::Graph(Policy::StoreAll))?;
    }
    Ok(())
}
