//! `remat bench auto`: auto plans executed by the engine on the GPT, against the
//! simulator's predictions and against the engine's fixed checkpointing policies
//! (issue 5, section 5). Every number is measured in this run; ratios are to store-all.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use remat_engine::models::gpt::Checkpointing;
use remat_engine::plan_exec::run_plan;
use remat_engine::policy::Policy;
use remat_engine::swap::{CopyEngine, HostStore, Throttle};
use remat_planner::{Planned, Problem};

use super::profile::{BuiltModel, ModelArgs, profile_model};
use super::train_auto::{measure_copy_bandwidth, mib};

#[derive(clap::Args)]
pub struct Args {
    /// Depths to run (the engine benchmark's GPT has 8 blocks; the second is twice as deep).
    #[arg(long, value_delimiter = ',', default_value = "8,16")]
    layers: Vec<usize>,
    /// Budgets as fractions of the store-all activation peak.
    #[arg(long, value_delimiter = ',', default_value = "0.9,0.7,0.5,0.3")]
    fractions: Vec<f64>,
    /// Timed steps per measurement (the median is reported).
    #[arg(long, default_value_t = 2)]
    runs: usize,
    /// A small model instead of the engine benchmark's (to try the benchmark quickly).
    #[arg(long)]
    quick: bool,
    #[arg(long, default_value_t = 2)]
    threads: usize,
}

/// One measured fixed policy.
struct Fixed {
    name: String,
    peak: u64,
    time: Duration,
}

fn model_args(args: &Args, layers: usize) -> ModelArgs {
    let (d, heads, seq, batch) = if args.quick {
        (64, 4, 32, 2)
    } else {
        (256, 8, 256, 8)
    };
    ModelArgs {
        model: "gpt".into(),
        layers,
        d_model: d,
        heads,
        seq,
        batch,
        vocab: 256,
        dropout: 0.0,
        threads: args.threads,
    }
}

fn fixed_policies(layers: usize) -> Vec<Checkpointing> {
    let mut v = vec![
        Checkpointing::Graph(Policy::StoreAll),
        Checkpointing::PerBlock,
        Checkpointing::SqrtBlocks,
        Checkpointing::Graph(Policy::Sqrt),
        Checkpointing::Graph(Policy::RecomputeAll),
    ];
    v.extend([2, 3, 4, 6, 8].map(|n| Checkpointing::Graph(Policy::EveryN(n))));
    if layers >= 4 {
        v.push(Checkpointing::Blocks(2));
    }
    v
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// Runs the engine's own policy `runs` times: pool peak and median step time.
fn measure_fixed(
    built: &BuiltModel,
    ctx: &remat_engine::ExecContext,
    ckpt: Checkpointing,
    runs: usize,
) -> anyhow::Result<Fixed> {
    let pool = ctx.pool();
    let mut times = Vec::new();
    let mut peak = 0;
    for _ in 0..runs {
        let mut step = built.record_with(ctx, 0, Some(ckpt))?;
        pool.reset_peak();
        let start = Instant::now();
        step.graph.forward()?;
        step.graph.backward(step.loss)?;
        times.push(start.elapsed());
        peak = peak.max(pool.peak());
    }
    Ok(Fixed {
        name: ckpt.to_string(),
        peak,
        time: median(times),
    })
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    for &layers in &args.layers {
        rows.extend(bench_depth(&args, layers)?);
    }
    let header = [
        "model",
        "budget",
        "budget MiB",
        "auto plan",
        "pred peak",
        "meas peak",
        "pred ms",
        "meas ms",
        "time err",
        "overhead",
        "stall ms",
        "best fixed",
        "fixed ms",
        "auto/fixed",
    ];
    println!("\n{}", render(&header, &rows));
    println!(
        "budget: fraction of the store-all activation peak (static memory added); peaks in MiB;"
    );
    println!(
        "overhead: measured step time over the executed store-all plan's; auto/fixed < 1 means auto is faster."
    );
    Ok(())
}

fn bench_depth(args: &Args, layers: usize) -> anyhow::Result<Vec<Vec<String>>> {
    let margs = model_args(args, layers);
    let bar = indicatif::ProgressBar::new(
        (fixed_policies(layers).len() + args.fractions.len() + 1) as u64,
    );
    bar.set_message(format!("{}: profiling", margs.label()));
    let (pool, ctx, built, _, profile) = profile_model(&margs, args.runs.max(1))?;
    bar.inc(1);
    let copy = CopyEngine::new(Arc::new(HostStore::in_memory()), Throttle::default());
    let bandwidth = measure_copy_bandwidth(&copy)?;
    let graph = &profile.graph;
    let static_bytes = graph.static_bytes();
    let activations = graph.store_all_peak() - static_bytes;
    let mut fixed = Vec::new();
    for ckpt in fixed_policies(layers) {
        bar.set_message(format!("{}: fixed policy {ckpt}", margs.label()));
        fixed.push(measure_fixed(&built, &ctx, ckpt, args.runs)?);
        bar.inc(1);
    }
    // The executed store-all plan is the time reference of every overhead.
    let store_all = remat_planner::lookup("store-all")?.plan(&Problem {
        graph,
        budget_bytes: u64::MAX,
        bandwidth,
    })?;
    let (base_time, _, _) = execute(&built, &ctx, &profile, &store_all, &copy, args.runs)?;
    let mut rows = Vec::new();
    for &f in &args.fractions {
        bar.set_message(format!("{}: budget {f}", margs.label()));
        let budget = static_bytes + (f * activations as f64) as u64;
        let problem = Problem {
            graph,
            budget_bytes: budget,
            bandwidth,
        };
        let best_fixed = fixed
            .iter()
            .filter(|x| x.peak <= budget)
            .min_by_key(|x| x.time);
        let mut row = vec![margs.label(), format!("{f:.1}"), mib(budget)];
        match remat_planner::plan_best(&problem) {
            Ok(planned) => {
                pool.set_budget(Some(budget));
                let measured = execute(&built, &ctx, &profile, &planned, &copy, args.runs);
                pool.set_budget(None);
                let (time, peak, stall) =
                    measured.with_context(|| format!("executing the plan for budget {f}"))?;
                let predicted = planned.report.total_time;
                row.extend([
                    planned.plan.strategy.clone(),
                    mib(planned.report.peak_bytes),
                    format!("{}{}", mib(peak), if peak <= budget { "" } else { " OVER" }),
                    format!("{:.1}", predicted * 1e3),
                    format!("{:.1}", time.as_secs_f64() * 1e3),
                    format!("{:+.1}%", (time.as_secs_f64() / predicted - 1.0) * 100.0),
                    format!(
                        "{:+.1}%",
                        (time.as_secs_f64() / base_time.as_secs_f64() - 1.0) * 100.0
                    ),
                    format!("{:.1}", stall.as_secs_f64() * 1e3),
                ]);
                match best_fixed {
                    Some(b) => row.extend([
                        b.name.clone(),
                        format!("{:.1}", b.time.as_secs_f64() * 1e3),
                        format!("{:.2}", time.as_secs_f64() / b.time.as_secs_f64()),
                    ]),
                    None => row.extend(["none fits".into(), "-".into(), "-".into()]),
                }
            }
            Err(e) => {
                row.push(format!("infeasible: {e}"));
                row.extend(std::iter::repeat_n("-".to_string(), 10));
            }
        }
        rows.push(row);
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(rows)
}

/// Executes a plan `runs` times: median step time, pool peak, median stall.
fn execute(
    built: &BuiltModel,
    ctx: &remat_engine::ExecContext,
    profile: &remat_engine::profile::StepProfile,
    planned: &Planned,
    copy: &CopyEngine,
    runs: usize,
) -> anyhow::Result<(Duration, u64, Duration)> {
    let mut times = Vec::new();
    let mut stalls = Vec::new();
    let mut peak = 0;
    for _ in 0..runs.max(1) {
        let mut step = built.record(ctx, 0)?;
        let report = run_plan(
            &mut step.graph,
            &profile.layout,
            profile.graph.name(),
            &planned.plan,
            Some(copy),
        )?;
        times.push(report.step_time);
        stalls.push(report.stall);
        peak = peak.max(report.peak_bytes);
    }
    Ok((median(times), peak, median(stalls)))
}

/// A plain aligned text table.
pub fn render(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let line = |cells: Vec<&str>| {
        cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    let mut out = line(header.to_vec()) + "\n";
    out += &line(
        widths
            .iter()
            .map(|&w| "-".repeat(w))
            .collect::<Vec<_>>()
            .iter()
            .map(String::as_str)
            .collect(),
    );
    out += "\n";
    for row in rows {
        out += &line(row.iter().map(String::as_str).collect());
        out += "\n";
    }
    out
}
