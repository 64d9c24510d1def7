//! `remat bench auto`: auto plans executed by the engine on the GPT, against the
//! simulator's predictions and against the engine's fixed checkpointing policies
//! (issue 5, section 5). Every number is measured in this run; the auto plan and the best
//! fixed policy of each budget are run alternately, so they see the same machine.

use std::sync::Arc;
use std::time::{Duration, Instant};

use remat_engine::core::swap::{CopyEngine, HostStore, Throttle};
use remat_engine::models::gpt::Checkpointing;
use remat_engine::plan_exec::profile::{
    StepProfile, calibrate_swap_cost, measure_copy_under_compute,
};
use remat_engine::plan_exec::{StepReport, choose_plan, run_plan};
use remat_engine::session::auto::{
    PROBE_BYTES, fixed_policies, fixed_policy_sets, measure_copy_bandwidth, mib,
};
use remat_engine::session::model::{BuiltModel, ModelOptions, profile_model};
use remat_engine::{ExecContext, Policy};
use remat_planner::{Planned, Problem};
use remat_report::{Layout, render};

use crate::error::{Context, Result};

#[derive(clap::Args)]
pub struct Args {
    /// Depths to run (the engine benchmark's GPT has 8 blocks; the second is twice as deep).
    #[arg(long, value_delimiter = ',', default_value = "8,16", value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    layers: Vec<usize>,
    /// Budgets as fractions of the store-all activation peak.
    #[arg(long, value_delimiter = ',', default_value = "0.9,0.7,0.5,0.3")]
    fractions: Vec<f64>,
    /// Timed steps per measurement (the median is reported).
    #[arg(long, default_value_t = 5, value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    runs: usize,
    /// A small model instead of the engine benchmark's (to try the benchmark quickly).
    #[arg(long)]
    quick: bool,
    #[arg(long, default_value_t = 2, value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    threads: usize,
    /// Relative step-time difference treated as noise when comparing auto with the best
    /// fixed policy.
    #[arg(long, default_value_t = 0.03)]
    noise: f64,
}

/// One measured fixed policy (the engine's own forward and backward).
struct Fixed {
    ckpt: Checkpointing,
    peak: u64,
    time: Duration,
    /// Timed steps behind `time` (1 for a policy too slow to repeat).
    runs: usize,
}

fn model_args(args: &Args, layers: usize) -> ModelOptions {
    let (d, heads, seq, batch) = if args.quick {
        (64, 4, 32, 2)
    } else {
        (256, 8, 256, 8)
    };
    ModelOptions {
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

fn median_time(v: Vec<Duration>) -> Duration {
    let secs: Vec<f64> = v.iter().map(Duration::as_secs_f64).collect();
    Duration::from_secs_f64(remat_units::median(&secs).unwrap_or(0.0))
}

/// One step under the engine's own policy: pool peak and wall time.
fn run_fixed(
    built: &BuiltModel,
    ctx: &ExecContext,
    ckpt: Checkpointing,
) -> Result<(u64, Duration)> {
    let pool = ctx.pool();
    let mut step = built.record_with(ctx, 0, Some(ckpt))?;
    pool.reset_peak();
    let start = Instant::now();
    step.graph.forward()?;
    step.graph.backward(step.loss)?;
    Ok((pool.peak(), start.elapsed()))
}

/// A fixed policy this many times slower than store-all (recompute-all's quadratic
/// rebuilding is ~25x at 8 blocks) is timed once: it is never the fastest fit of a budget
/// that a faster policy also meets, and repeating it would make the benchmark take hours.
const SLOW_POLICY: f64 = 3.0;

/// The engine's own policy `runs` times (after a warm-up): pool peak and median time. A
/// policy whose warm-up took over [`SLOW_POLICY`] times `reference` reports that one time.
fn measure_fixed(
    built: &BuiltModel,
    ctx: &ExecContext,
    ckpt: Checkpointing,
    runs: usize,
    reference: Option<Duration>,
) -> Result<Fixed> {
    let (first_peak, first) = run_fixed(built, ctx, ckpt)?;
    if reference.is_some_and(|r| first.as_secs_f64() > SLOW_POLICY * r.as_secs_f64()) {
        return Ok(Fixed {
            ckpt,
            peak: first_peak,
            time: first,
            runs: 1,
        });
    }
    let mut times = Vec::new();
    let mut peak = 0;
    for _ in 0..runs.max(1) {
        let (p, t) = run_fixed(built, ctx, ckpt)?;
        peak = peak.max(p);
        times.push(t);
    }
    Ok(Fixed {
        ckpt,
        peak,
        time: median_time(times),
        runs: runs.max(1),
    })
}

/// One step by a plan.
fn run_once(
    built: &BuiltModel,
    ctx: &ExecContext,
    profile: &StepProfile,
    planned: &Planned,
    copy: &CopyEngine,
) -> Result<StepReport> {
    let mut step = built.record(ctx, 0)?;
    Ok(run_plan(
        &mut step.graph,
        &profile.layout,
        profile.graph.name(),
        &planned.plan,
        Some(copy),
    )?)
}

/// Medians over rounds of a plan and, in the same rounds, of the executed store-all plan
/// and of a fixed policy.
struct Measured {
    time: Duration,
    peak: u64,
    stall: Duration,
    /// Median over rounds of the plan's time over the store-all plan's in the same round.
    over_base: Option<f64>,
    fixed_time: Option<Duration>,
    /// Median over rounds of the plan's time over the fixed policy's in the same round.
    over_fixed: Option<f64>,
}

/// What runs beside the plan in each round.
struct Beside<'a> {
    /// The executed store-all plan (run without the budget).
    base: Option<&'a Planned>,
    fixed: Option<Checkpointing>,
    /// The pool budget the plan runs under.
    budget: Option<u64>,
}

fn paired_median(num: &[Duration], den: &[Duration]) -> Option<f64> {
    let secs = |v: &[Duration]| v.iter().map(Duration::as_secs_f64).collect::<Vec<_>>();
    (!den.is_empty()).then(|| crate::ratio::paired_median(&secs(num), &secs(den)))
}

/// Runs a plan in rounds, each also running what `beside` names, so that every number of a
/// row sees the same machine: on a shared machine the speed drifts by tens of percent over
/// minutes, and comparing a run now with a profile taken minutes ago would measure the
/// drift, not the plan.
fn measure_side_by_side(
    built: &BuiltModel,
    ctx: &ExecContext,
    profile: &StepProfile,
    planned: &Planned,
    copy: &CopyEngine,
    beside: &Beside,
    runs: usize,
) -> Result<Measured> {
    let pool = ctx.pool();
    let plan_step = || -> Result<StepReport> {
        pool.set_budget(beside.budget);
        let report = run_once(built, ctx, profile, planned, copy);
        pool.set_budget(None);
        report
    };
    plan_step()?;
    let (mut times, mut stalls, mut bases, mut fixed_times) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut peak = 0;
    for _ in 0..runs.max(1) {
        let report = plan_step()?;
        times.push(report.step_time);
        stalls.push(report.stall);
        peak = peak.max(report.peak_bytes);
        if let Some(base) = beside.base {
            bases.push(run_once(built, ctx, profile, base, copy)?.step_time);
        }
        if let Some(ckpt) = beside.fixed {
            fixed_times.push(run_fixed(built, ctx, ckpt)?.1);
        }
    }
    Ok(Measured {
        time: median_time(times.clone()),
        peak,
        stall: median_time(stalls),
        over_base: paired_median(&times, &bases),
        over_fixed: paired_median(&times, &fixed_times),
        fixed_time: beside.fixed.map(|_| median_time(fixed_times)),
    })
}

pub fn run(args: Args) -> Result<()> {
    let mut rows = Vec::new();
    let mut notes = Vec::new();
    for &layers in &args.layers {
        let (r, n) = bench_depth(&args, layers)?;
        rows.extend(r);
        notes.extend(n);
    }
    for note in &notes {
        println!("{note}");
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
        "raw err",
        "pred overhead",
        "meas overhead",
        "time err",
        "stall ms",
        "swapped MiB",
        "best fixed",
        "fixed peak",
        "fixed ms",
        "auto/fixed",
        "goals",
    ];
    println!("\n{}", render(Layout::Plain, &header, &rows));
    println!(
        "budget: fraction of the store-all activation peak (static memory added); peaks in MiB;"
    );
    println!(
        "overhead: step time over store-all's, predicted (planner) and measured (median of the per-round ratios to the executed store-all plan, run in the same rounds); raw err: measured ms over predicted ms (includes the machine's drift since profiling); time err: measured overhead against predicted overhead, the goal's measure; auto/fixed: median per-round ratio, < 1 means auto is faster;"
    );
    println!(
        "goals: ok, or what failed: OVER (peak above budget), TIME (measured more than 10% off predicted), SLOWER (auto slower than the best fixed policy beyond {:.0}% noise).",
        args.noise * 100.0
    );
    Ok(())
}

type Rows = (Vec<Vec<String>>, Vec<String>);

fn bench_depth(args: &Args, layers: usize) -> Result<Rows> {
    let margs = model_args(args, layers);
    let label = margs.label();
    let policies = fixed_policies(layers);
    let bar = indicatif::ProgressBar::new((policies.len() + args.fractions.len() + 2) as u64);
    bar.set_message(format!("{label}: profiling"));
    let (_pool, ctx, built, mut step, profile) = profile_model(&margs, args.runs.max(1))?;
    bar.inc(1);
    let copy = CopyEngine::new(Arc::new(HostStore::in_memory()), Throttle::default());
    let idle_bandwidth = measure_copy_bandwidth(&copy)?;
    let copies = measure_copy_under_compute(&mut step.graph, &profile, &copy, 3, PROBE_BYTES)?;
    let bandwidth = copies.bandwidth;
    let calibrated = calibrate_swap_cost(&mut step.graph, &profile, &copy, bandwidth, 5)?;
    let copy_cost = calibrated.unwrap_or(copies.compute_seconds_per_byte);
    let sets = fixed_policy_sets(&step.graph, &policies, |ckpt| {
        built.record_with(&ctx, 0, Some(ckpt)).map(|s| s.graph)
    })?;
    drop(step);
    let graph = &profile.graph;
    let static_bytes = graph.static_bytes();
    let activations = graph.store_all_peak() - static_bytes;
    let mut fixed = Vec::new();
    for &ckpt in &policies {
        bar.set_message(format!("{label}: fixed policy {ckpt}"));
        let reference = fixed.first().map(|f: &Fixed| f.time);
        fixed.push(measure_fixed(&built, &ctx, ckpt, args.runs, reference)?);
        bar.inc(1);
    }
    // The executed store-all plan: the time reference of every overhead, and its peak
    // against the engine's own store-all.
    let store_all = remat_planner::lookup("store-all")?.plan(&Problem {
        graph,
        budget_bytes: u64::MAX,
        bandwidth,
    })?;
    let alone = Beside {
        base: None,
        fixed: None,
        budget: None,
    };
    let base = measure_side_by_side(&built, &ctx, &profile, &store_all, &copy, &alone, args.runs)?;
    bar.inc(1);
    let engine_store_all = fixed
        .iter()
        .find(|f| f.ckpt == Checkpointing::Graph(Policy::StoreAll))
        .map_or(0, |f| f.peak);
    let notes = vec![
        format!(
            "\n{label}: static {} MiB, store-all peak: planned {} MiB, executed {} MiB, engine's own {} MiB; copy bandwidth {:.2} GB/s idle, {:.2} GB/s while computing (planned with); a swap costs the step {:.2} ms per MiB copied ({})",
            mib(static_bytes),
            mib(store_all.report.peak_bytes),
            mib(base.peak),
            mib(engine_store_all),
            idle_bandwidth / 1e9,
            bandwidth / 1e9,
            copy_cost * 1e3 * (1u64 << 20) as f64,
            if calibrated.is_some() {
                "measured on a swapping plan against store-all"
            } else {
                "measured by the copy probe"
            }
        ),
        render(
            Layout::Plain,
            &[
                "fixed policy",
                "peak MiB",
                "peak / store-all",
                "ms",
                "timed steps",
            ],
            &fixed
                .iter()
                .map(|f| {
                    vec![
                        f.ckpt.to_string(),
                        mib(f.peak),
                        format!("{:.2}", f.peak as f64 / engine_store_all.max(1) as f64),
                        format!("{:.1}", f.time.as_secs_f64() * 1e3),
                        f.runs.to_string(),
                    ]
                })
                .collect::<Vec<_>>(),
        ),
    ];
    let mut rows = Vec::new();
    for &f in &args.fractions {
        bar.set_message(format!("{label}: budget {f}"));
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
        let mut row = vec![label.clone(), format!("{f:.1}"), mib(budget)];
        match choose_plan(&problem, &profile.layout, None, &sets, copy_cost) {
            Ok(choice) => {
                let planned = &choice.planned;
                let beside = Beside {
                    base: Some(&store_all),
                    fixed: best_fixed.map(|b| b.ckpt),
                    budget: Some(budget),
                };
                let m = measure_side_by_side(
                    &built, &ctx, &profile, planned, &copy, &beside, args.runs,
                )
                .with_context(|| format!("executing the plan for budget {f}"))?;
                let predicted = planned.report.total_time;
                let time = m.time.as_secs_f64();
                let raw_err = time / predicted - 1.0;
                // The planner's prediction relative to its own store-all prediction, against
                // the measured time relative to store-all run in the same rounds.
                let predicted_over = predicted / store_all.report.total_time.max(1e-12);
                let measured_over = m.over_base.unwrap_or(f64::NAN);
                let err = measured_over / predicted_over - 1.0;
                let mut goals = Vec::new();
                if m.peak > budget {
                    goals.push("OVER");
                }
                if err.is_nan() || err.abs() > 0.10 {
                    goals.push("TIME");
                }
                row.extend([
                    planned.plan.strategy.clone(),
                    mib(planned.report.peak_bytes),
                    mib(m.peak),
                    format!("{:.1}", predicted * 1e3),
                    format!("{:.1}", time * 1e3),
                    format!("{:+.1}%", raw_err * 100.0),
                    format!("{:+.1}%", (predicted_over - 1.0) * 100.0),
                    format!("{:+.1}%", (measured_over - 1.0) * 100.0),
                    format!("{:+.1}%", err * 100.0),
                    format!("{:.1}", m.stall.as_secs_f64() * 1e3),
                    mib(planned.report.swapped_out_bytes),
                ]);
                match (best_fixed, m.fixed_time, m.over_fixed) {
                    (Some(b), Some(ft), Some(ratio)) => {
                        if ratio > 1.0 + args.noise {
                            goals.push("SLOWER");
                        }
                        row.extend([
                            b.ckpt.to_string(),
                            mib(b.peak),
                            format!("{:.1}", ft.as_secs_f64() * 1e3),
                            format!("{ratio:.2}"),
                        ]);
                    }
                    _ => row.extend(["none fits".into(), "-".into(), "-".into(), "-".into()]),
                }
                row.push(if goals.is_empty() {
                    "ok".into()
                } else {
                    goals.join(" ")
                });
            }
            Err(e) => {
                row.push(format!("infeasible: {e}"));
                row.extend(std::iter::repeat_n("-".to_string(), 15));
            }
        }
        rows.push(row);
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok((rows, notes))
}
