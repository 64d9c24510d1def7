//! `remat bench multi` (issue 22): K = 1, 2, 4 copies of a small GPT trained at a budget
//! where one model fits whole but K models do not. For each K, side by side in one run:
//! total throughput (samples per second over all models) and pool peak of
//!
//! - (a) `one-after-another`: each model's step alone, one after another (each fits whole);
//! - (b) `together, unfused`: the K models in one step (K loss roots), each model's ops on
//!   their own, run by the auto plan (every planner strategy and fixed policy, swaps
//!   allowed) for the budget;
//! - (c) `fused, recompute only`: the K models' ops fused (one call per op over all K,
//!   [`remat_engine::models::fused`]), planned for a host link too slow to use, so the
//!   chosen plan only recomputes (its swap traffic is printed: 0);
//! - (d) `fused groups, multiplexed MuTWO`: the K models fused into two groups of K/2 (MuTWO's
//!   fused sub-arrays), the two groups' steps interleaved as the planner's multiplexed graph
//!   (group 0's backward beside group 1's forward) under MuTWO's Algorithm C, so one group's
//!   prefetch can hide behind the other's compute (`--policy auto:multiplexed
//!   --fuse-width K/2`);
//! - (e) `fused groups, multiplexed search`: the same graph planned by the anytime search;
//! - (f) `fused, auto plan`: all K fused in one unit, run by the auto plan.
//!
//! At K = 2 the two groups of (d) and (e) are single models: unfused, multiplexed. Ratios
//! are against (a) at the same K, measured in the same run.

use std::time::Instant;

use remat_engine::core::graph::Graph;
use remat_engine::models::fused::{ModelSet, SetStep};
use remat_engine::models::gpt::{Checkpointing, GptConfig};
use remat_engine::models::multi::{step_optimizers, take_grads};
use remat_engine::plan_exec::swap_traffic;
use remat_engine::session::auto::{
    AutoSession, AutoSettings, fixed_policies, fixed_policy_sets, mib,
};
use remat_engine::session::models::{Members, Models, limit_fuse_width};
use remat_engine::session::task::Task;
use remat_engine::{ExecContext, MemoryPool, Policy};
use remat_report::{Layout, render};
use remat_units::median;

use crate::error::{Context, Result, chain, ensure, failed};

#[derive(clap::Args)]
pub struct Args {
    /// Numbers of models trained together.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4", value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    ks: Vec<usize>,
    #[arg(long, default_value_t = 4, value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    layers: usize,
    #[arg(long, default_value_t = 64, value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    d_model: usize,
    #[arg(long, default_value_t = 4, value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    heads: usize,
    /// Sequences per step and model.
    #[arg(long, default_value_t = 32, value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    batch: usize,
    /// Digits of the reversal task (sequence length 2 x digits).
    #[arg(long, default_value_t = 12, value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    digits: usize,
    /// Timed steps per row, after one warm-up step (the median step time is reported).
    #[arg(long, default_value_t = 5, value_parser = remat_units::flag::count::<u64>, allow_hyphen_values = true)]
    steps: u64,
    /// The budget as a multiple of one model's store-all peak (> 1: one model fits whole).
    #[arg(long, default_value_t = 1.1)]
    budget_factor: f64,
    #[arg(long, default_value_t = 2, value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    threads: usize,
}

/// What a row of the table measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowKind {
    /// (a) each model's step alone, one after another.
    OneAfterAnother,
    /// (b) the K models in one step, unfused, by the auto plan (swap and recompute).
    Together,
    /// (c) the K models fused, by a plan that only recomputes.
    FusedRecompute,
    /// (d) two fused groups by the planner's multiplexed plan (MuTWO's Algorithm C on the
    /// interleaved order).
    FusedMultiplexed,
    /// (e) the same multiplexed graph planned by the anytime search.
    FusedMultiplexedSearch,
    /// (f) the K models fused in one unit, by the auto plan.
    FusedAuto,
}

impl RowKind {
    const ALL: [RowKind; 6] = [
        RowKind::OneAfterAnother,
        RowKind::Together,
        RowKind::FusedRecompute,
        RowKind::FusedMultiplexed,
        RowKind::FusedMultiplexedSearch,
        RowKind::FusedAuto,
    ];

    fn label(self) -> &'static str {
        match self {
            RowKind::OneAfterAnother => "(a) one after another",
            RowKind::Together => "(b) together, unfused, auto plan",
            RowKind::FusedRecompute => "(c) fused, recompute only",
            RowKind::FusedMultiplexed => "(d) fused groups, multiplexed MuTWO",
            RowKind::FusedMultiplexedSearch => "(e) fused groups, multiplexed search",
            RowKind::FusedAuto => "(f) fused, auto plan",
        }
    }
}

/// A measured row.
struct Row {
    samples_per_s: f64,
    /// Throughput over (a)'s at the same K: the median of per-round ratios.
    vs_a: f64,
    peak: u64,
    stall_ms: f64,
    note: String,
}

/// One mode set up for K models: each call trains every model one step.
trait Runner {
    /// Runs step `step` of every model: (wall seconds, swap stall seconds).
    fn step(&mut self, step: u64) -> Result<(f64, f64)>;
    fn peak(&self) -> u64;
    fn note(&self) -> String;
}

fn config(args: &Args, vocab: usize, seed: u64) -> GptConfig {
    GptConfig {
        vocab,
        d_model: args.d_model,
        n_layers: args.layers,
        n_heads: args.heads,
        n_kv_heads: args.heads,
        ffn_hidden: (8 * args.d_model).div_ceil(3).div_ceil(16) * 16,
        rope_theta: 10000.0,
        norm_eps: 1e-5,
        dropout: 0.1,
        init_seed: seed,
    }
}

fn members(args: &Args, vocab: usize, k: usize) -> Members {
    Members {
        configs: (0..k as u64).map(|s| config(args, vocab, s)).collect(),
        lrs: vec![3e-3; k],
        seeds: (0..k as u64).collect(),
    }
}

pub fn run(args: Args) -> Result<()> {
    ensure!(
        args.ks.iter().all(|&k| k >= 1),
        "--ks: every K must be at least 1"
    );
    ensure!(args.steps >= 1, "--steps must be at least 1");
    ensure!(args.budget_factor > 0.0, "--budget-factor must be positive");
    let task = Task::reverse(args.digits)?;
    let one_peak = store_all_peak(&args, &task)?;
    let budget = (one_peak as f64 * args.budget_factor) as u64;
    println!(
        "remat bench multi: GPT L={} d={} heads={} batch {} x seq {} per model, dropout 0.1 | budget {} MiB = {} x one model's store-all peak ({} MiB) | {} threads | {} timed steps per row",
        args.layers,
        args.d_model,
        args.heads,
        args.batch,
        task.seq(),
        mib(budget),
        args.budget_factor,
        mib(one_peak),
        args.threads,
        args.steps
    );
    let mut rows = Vec::new();
    for &k in &args.ks {
        let measured = measure_k(&args, &task, k, budget).with_context(|| format!("K = {k}"))?;
        for (kind, row) in RowKind::ALL.iter().zip(measured) {
            rows.push(match row {
                Ok(row) => vec![
                    k.to_string(),
                    kind.label().into(),
                    format!("{:.1}", row.samples_per_s),
                    format!("{:.2}", row.vs_a),
                    mib(row.peak),
                    format!("{:.1}", row.stall_ms),
                    row.note,
                ],
                Err(why) => vec![
                    k.to_string(),
                    kind.label().into(),
                    "-".into(),
                    "-".into(),
                    "-".into(),
                    "-".into(),
                    why,
                ],
            });
        }
    }
    print!(
        "{}",
        render(
            Layout::Aligned,
            &[
                "K",
                "mode",
                "samples/s",
                "vs (a)",
                "peak MiB",
                "stall ms",
                "plan"
            ],
            &rows
        )
    );
    Ok(())
}

/// One model's store-all peak (static memory included), measured on a step.
fn store_all_peak(args: &Args, task: &Task) -> Result<u64> {
    let pool = MemoryPool::unbounded();
    let ctx = ExecContext::new(pool.clone(), args.threads)?;
    let models = Models::new(&pool, &members(args, task.vocab(), 1))?;
    let batches = models.batches(task, 0, args.batch);
    let mut g = Graph::new(&ctx);
    let step = models.record(&mut g, &batches, 0, store_all())?;
    g.forward()?;
    g.backward_many(&step.losses)?;
    drop(g);
    Ok(pool.stats().peak)
}

fn store_all() -> Checkpointing {
    Checkpointing::Graph(Policy::StoreAll)
}

/// How the K models form units in a row: each alone, all fused in one unit, or fused in
/// two groups (MuTWO's sub-arrays, multiplexed under a plan).
fn units(args: &Args, task: &Task, k: usize, kind: RowKind) -> ModelSet {
    let members = members(args, task.vocab(), k);
    let fused = members.set(args.batch, task.seq(), true);
    match kind {
        RowKind::OneAfterAnother | RowKind::Together => members.set(args.batch, task.seq(), false),
        RowKind::FusedMultiplexed | RowKind::FusedMultiplexedSearch => {
            limit_fuse_width(&fused, k.div_ceil(2))
        }
        RowKind::FusedRecompute | RowKind::FusedAuto => fused,
    }
}

/// Sets up a runner per row kind (`None`: a kind that cannot run).
fn runner<'a>(
    threads: &ExecContext,
    args: &Args,
    task: &'a Task,
    k: usize,
    budget: u64,
    kind: RowKind,
) -> Result<Option<Box<dyn Runner + 'a>>> {
    let set = units(args, task, k, kind);
    let together =
        |bandwidth: Option<f64>, strategy: Option<&str>| -> Result<Option<Box<dyn Runner + 'a>>> {
            Ok(Some(Box::new(Together::new(
                threads,
                args,
                task,
                k,
                budget,
                bandwidth,
                strategy,
                set.clone(),
            )?)))
        };
    match kind {
        RowKind::OneAfterAnother => Ok(Some(Box::new(OneAfterAnother::new(
            threads, args, task, k, budget,
        )?))),
        RowKind::Together | RowKind::FusedAuto => together(None, None),
        // A link of one byte per second: every swap would cost more than any recompute.
        RowKind::FusedRecompute => together(Some(1.0), None),
        // The planner's multiplexed graph (the units' steps interleaved) under MuTWO's
        // Algorithm C: `remat train --models K --policy auto:multiplexed`.
        RowKind::FusedMultiplexed => together(None, Some("multiplexed")),
        RowKind::FusedMultiplexedSearch => together(None, Some("multiplexed-search")),
    }
}

/// Every row kind at K models: one warm-up step each, then `--steps` rounds in which every
/// runner trains one step, so all rows see the same machine; ratios against (a) are
/// medians of per-round ratios. A row that cannot run (a kind not wired in yet, or no plan
/// fitting the budget) is `Err` with the reason.
fn measure_k(args: &Args, task: &Task, k: usize, budget: u64) -> Result<Vec<Result<Row, String>>> {
    // One set of worker threads for every row (each row keeps its own memory pool): with a
    // thread pool per row, one row's idle workers would spin beside the next row's work.
    let threads = ExecContext::new(MemoryPool::unbounded(), args.threads)?;
    let mut runners = Vec::new();
    let mut skipped = Vec::new();
    for kind in RowKind::ALL {
        let made = runner(&threads, args, task, k, budget, kind);
        let why = match &made {
            Ok(Some(_)) => String::new(),
            Ok(None) => "not run".into(),
            // (a) always fits (the budget is above one model's store-all peak).
            Err(e) if kind == RowKind::OneAfterAnother => {
                return Err(failed!("{}: {}", kind.label(), chain(e)));
            }
            Err(e) => format!("not run: {}", chain(e)),
        };
        runners.push(made.ok().flatten());
        skipped.push(why);
    }
    for r in runners.iter_mut().flatten() {
        r.step(0)?;
    }
    let mut times = vec![Vec::new(); runners.len()];
    let mut stalls = vec![Vec::new(); runners.len()];
    for step in 1..=args.steps {
        for (i, r) in runners.iter_mut().enumerate() {
            if let Some(r) = r {
                let (t, stall) = r.step(step)?;
                times[i].push(t);
                stalls[i].push(stall);
            }
        }
    }
    let samples = (k * args.batch) as f64;
    Ok(runners
        .iter()
        .enumerate()
        .map(|(i, r)| match r {
            Some(r) => Ok(Row {
                samples_per_s: samples / median(&times[i]).unwrap_or(0.0).max(1e-12),
                vs_a: crate::ratio::paired_median(&times[0], &times[i]),
                peak: r.peak(),
                stall_ms: median(&stalls[i]).unwrap_or(0.0) * 1e3,
                note: r.note(),
            }),
            None => Err(skipped[i].clone()),
        })
        .collect())
}

/// (a): the K models trained one after another, each alone on the device (its own pool
/// under the budget, where it fits whole). A round runs one step of each in turn: the same
/// work per sample as training each to the end before the next.
struct OneAfterAnother<'a> {
    task: &'a Task,
    batch: usize,
    alone: Vec<(ExecContext, Models)>,
}

impl<'a> OneAfterAnother<'a> {
    fn new(
        threads: &ExecContext,
        args: &Args,
        task: &'a Task,
        k: usize,
        budget: u64,
    ) -> Result<Self> {
        let all = members(args, task.vocab(), k);
        let mut alone = Vec::with_capacity(k);
        for i in 0..k {
            let ctx = threads.with_pool(MemoryPool::with_budget(budget));
            let one = Members {
                configs: vec![all.configs[i].clone()],
                lrs: vec![all.lrs[i]],
                seeds: vec![all.seeds[i]],
            };
            let models = Models::new(ctx.pool(), &one)?;
            alone.push((ctx, models));
        }
        Ok(OneAfterAnother {
            task,
            batch: args.batch,
            alone,
        })
    }
}

impl Runner for OneAfterAnother<'_> {
    fn step(&mut self, step: u64) -> Result<(f64, f64)> {
        let start = Instant::now();
        for (ctx, m) in &mut self.alone {
            let batches = m.batches(self.task, step, self.batch);
            let mut g = Graph::new(ctx);
            let rec = m.record(&mut g, &batches, step, store_all())?;
            g.forward()?;
            g.backward_many(&rec.losses)?;
            let grads = take_grads(&mut g, &rec.params)?;
            drop(g);
            ctx.install(|| step_optimizers(&mut m.opts, &grads))?;
        }
        Ok((start.elapsed().as_secs_f64(), 0.0))
    }

    fn peak(&self) -> u64 {
        self.alone
            .iter()
            .map(|(ctx, _)| ctx.pool().stats().peak)
            .max()
            .unwrap_or(0)
    }

    fn note(&self) -> String {
        "store-all, each model alone on the device".into()
    }
}

/// (b) to (f): the K-model step (one loss root per unit) profiled, planned for the budget,
/// and run by the plan.
struct Together<'a> {
    task: &'a Task,
    batch: usize,
    ctx: ExecContext,
    models: Models,
    set: ModelSet,
    opts: Vec<remat_engine::AdamW>,
    session: AutoSession,
    peak: u64,
}

impl<'a> Together<'a> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        threads: &ExecContext,
        args: &Args,
        task: &'a Task,
        k: usize,
        budget: u64,
        bandwidth: Option<f64>,
        strategy: Option<&str>,
        set: ModelSet,
    ) -> Result<Self> {
        let pool = MemoryPool::unbounded();
        let ctx = threads.with_pool(pool.clone());
        let mut models = Models::new(&pool, &members(args, task.vocab(), k))?;
        let opts = std::mem::take(&mut models.opts);
        let record = |ckpt: Checkpointing| -> Result<(Graph, SetStep)> {
            let mut g = Graph::new(&ctx);
            let batches = models.batches(task, 0, args.batch);
            let rec = models.record_set(&mut g, &batches, 0, ckpt, &set)?;
            Ok((g, rec))
        };
        let (mut g0, step0) = record(store_all())?;
        let fixed = match strategy {
            Some(_) => Vec::new(),
            None => fixed_policy_sets(&g0, &fixed_policies(args.layers), |ckpt| {
                record(ckpt).map(|(g, _)| g)
            })?,
        };
        let settings = AutoSettings {
            budget,
            strategy: strategy.map(String::from),
            swap_dir: None,
            bandwidth,
            profile_runs: 3,
            fixed,
        };
        let name = format!("bench-multi-k{k}");
        let session = AutoSession::prepare_multi(&mut g0, &step0.roots, &name, &settings)?;
        drop(g0);
        pool.set_budget(Some(budget));
        Ok(Together {
            task,
            batch: args.batch,
            ctx,
            models,
            set,
            opts,
            session,
            peak: 0,
        })
    }
}

impl Runner for Together<'_> {
    fn step(&mut self, step: u64) -> Result<(f64, f64)> {
        let start = Instant::now();
        let mut g = Graph::new(&self.ctx);
        let batches = self.models.batches(self.task, step, self.batch);
        let rec = self
            .models
            .record_set(&mut g, &batches, step, store_all(), &self.set)?;
        let report = self.session.step(&mut g)?;
        let grads = take_grads(&mut g, &rec.params)?;
        drop(g);
        let opts = &mut self.opts;
        self.ctx.install(|| step_optimizers(opts, &grads))?;
        self.peak = self.peak.max(report.peak_bytes);
        Ok((start.elapsed().as_secs_f64(), report.stall.as_secs_f64()))
    }

    fn peak(&self) -> u64 {
        self.peak
    }

    fn note(&self) -> String {
        let s = &self.session;
        let units: Vec<String> = (0..self.set.units.len())
            .map(|u| self.set.label(u))
            .collect();
        format!(
            "units {}: {} (swaps {} MiB, simulated peak {} MiB)",
            units.join(" "),
            s.planned.plan.strategy,
            mib(swap_traffic(&s.profile.graph, &s.planned.plan)),
            mib(s.planned.report.peak_bytes)
        )
    }
}
