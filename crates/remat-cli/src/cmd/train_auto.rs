//! `remat train --policy auto[:STRATEGY] --memory-budget B`: profile the first step, plan it
//! for the budget, and run every step by the plan (issue 5, section 3).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use remat_engine::graph::{Graph, NodeId};
use remat_engine::models::gpt::{Checkpointing, Gpt, hf};
use remat_engine::{AdamW, AdamWConfig, ExecContext, MemoryPool, Policy};

use super::train::Args;
use super::train::task::Task;
use remat_engine::plan_exec::{
    Considered, StepReport, choose_plan, kept_nodes, run_plan, same_nodes,
};
use remat_engine::profile::{
    CopyUnderCompute, ProfileOptions, StepProfile, calibrate_swap_cost, measure_copy_under_compute,
    median, profile_step_multi,
};
use remat_engine::swap::{CopyEngine, HostStore, Throttle};
use remat_planner::multi::MultiPlanned;
use remat_planner::{PlanError, Planned, Problem};
use remat_units::{human_bandwidth, human_bytes};

use super::train_multi::multiplexed;

/// What `--policy auto` needs besides the model.
#[derive(Clone, Debug)]
pub struct AutoSettings {
    /// Device budget in bytes, static memory (parameters, gradients, optimizer state) included.
    pub budget: u64,
    /// A registered strategy, or `None` for the fastest plan of all that fit.
    pub strategy: Option<String>,
    /// Keep swapped tensors in a memory-mapped file in this directory instead of in memory.
    pub swap_dir: Option<PathBuf>,
    /// Host-device bandwidth to plan with (bytes/s), copies then taken as free for the
    /// compute; if `None`, both are measured on the copy engine while the step computes.
    pub bandwidth: Option<f64>,
    /// Timed profiling runs.
    pub profile_runs: usize,
    /// The engine's fixed policies as candidate plans: name and the engine nodes each keeps
    /// (indexed like the profiled graph; see [`fixed_policy_sets`]).
    pub fixed: Vec<(String, Vec<bool>)>,
}

/// The engine's fixed checkpointing policies the auto choice and the benchmark weigh
/// against the planner's strategies.
pub fn fixed_policies(layers: usize) -> Vec<Checkpointing> {
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

/// The kept engine nodes of each fixed policy: `record` records the profiled step under a
/// policy. A recording whose nodes differ from `reference`'s is skipped (its kept set would
/// not index the profiled layout).
pub fn fixed_policy_sets(
    reference: &Graph,
    policies: &[Checkpointing],
    mut record: impl FnMut(Checkpointing) -> anyhow::Result<Graph>,
) -> anyhow::Result<Vec<(String, Vec<bool>)>> {
    let mut sets = Vec::with_capacity(policies.len());
    for &ckpt in policies {
        let g = record(ckpt)?;
        if same_nodes(reference, &g) {
            sets.push((ckpt.to_string(), kept_nodes(&g)));
        }
    }
    Ok(sets)
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

/// `remat train` flags that `--policy auto` does not use: refused rather than ignored.
pub fn check_flags(args: &Args) -> anyhow::Result<()> {
    match first_unused_flag(args, &[]) {
        Some(flag) => anyhow::bail!(
            "{flag} cannot be combined with --policy auto: auto profiles and plans the \
             single-stage GPT step itself (drop {flag}, or use a fixed --policy)"
        ),
        None => Ok(()),
    }
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
        None => super::train::parse_policy(s).map(PolicyChoice::Fixed),
    }
}

/// A profiled and planned training step, ready to run step after step.
pub struct AutoSession {
    pub profile: StepProfile,
    pub planned: Planned,
    /// Every candidate plan weighed, with its predicted time or why it was left out.
    pub considered: Vec<Considered>,
    pub copy: CopyEngine,
    pub bandwidth: f64,
    /// Compute seconds a byte of swap traffic takes from the step (charged to predictions).
    pub copy_cost: f64,
    pub budget: u64,
    /// Under `--policy auto:multiplexed[-search]` (K models): the multiplexed plan with
    /// which model's compute hides which swap.
    pub multiplexed: Option<MultiPlanned>,
}

/// Bytes in MiB without the unit, for table columns headed in MiB (prose uses
/// [`remat_units::human_bytes`]).
pub fn mib(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / (1024.0 * 1024.0))
}

/// Copies 32 MiB out and back through the copy engine (after one warm-up round that pays
/// the page faults): its bytes per second, one way.
pub fn measure_copy_bandwidth(copy: &CopyEngine) -> anyhow::Result<f64> {
    let n = 8 << 20;
    let mut buf = vec![1.0f32; n];
    let mut secs = f64::INFINITY;
    for _ in 0..3 {
        let start = Instant::now();
        let (slot, out) = copy.offload(buf, "bandwidth probe")?.wait()?.value;
        buf = copy.prefetch(slot, out, true)?.wait()?.value;
        secs = secs.min(start.elapsed().as_secs_f64().max(1e-9));
    }
    copy.reset_stats();
    Ok(2.0 * (n * 4) as f64 / secs)
}

impl AutoSession {
    /// Profiles the step recorded in `graph` (ending in `loss`) and plans it for the budget.
    /// A budget no plan meets is an error stating the smallest feasible budget.
    pub fn prepare(
        graph: &mut Graph,
        loss: NodeId,
        name: &str,
        settings: &AutoSettings,
    ) -> anyhow::Result<Self> {
        Self::prepare_multi(graph, &[loss], name, settings)
    }

    /// [`AutoSession::prepare`] for a step with several loss roots (K models recorded into
    /// one graph, `remat train --models K`).
    pub fn prepare_multi(
        graph: &mut Graph,
        losses: &[NodeId],
        name: &str,
        settings: &AutoSettings,
    ) -> anyhow::Result<Self> {
        let store = match &settings.swap_dir {
            Some(dir) => {
                HostStore::on_disk(dir).with_context(|| format!("--swap-dir {}", dir.display()))?
            }
            None => HostStore::in_memory(),
        };
        let copy = CopyEngine::new(Arc::new(store), Throttle::default());
        let opts = ProfileOptions {
            runs: settings.profile_runs,
            name: name.to_string(),
        };
        let profile =
            profile_step_multi(graph, losses, &opts).context("profiling the training step")?;
        let copies = match settings.bandwidth {
            Some(bandwidth) => CopyUnderCompute {
                bandwidth,
                compute_seconds_per_byte: 0.0,
            },
            None => {
                let probed = measure_copy_under_compute(graph, &profile, &copy, 3, PROBE_BYTES)
                    .context("measuring the copy bandwidth while the step computes")?;
                let calibrated = calibrate_swap_cost(graph, &profile, &copy, probed.bandwidth, 5)
                    .context("measuring what swaps cost the step")?;
                CopyUnderCompute {
                    compute_seconds_per_byte: calibrated.unwrap_or(probed.compute_seconds_per_byte),
                    ..probed
                }
            }
        };
        let bandwidth = copies.bandwidth;
        let problem = Problem {
            graph: &profile.graph,
            budget_bytes: settings.budget,
            bandwidth,
        };
        let route = settings
            .strategy
            .as_deref()
            .and_then(multiplexed::inner_strategy);
        let (planned, considered, multiplexed) = match route {
            Some(inner) => {
                let (multi, planned, considered) =
                    multiplexed::plan(graph, &profile, settings.budget, bandwidth, inner)?;
                (planned, considered, Some(multi))
            }
            None => {
                let (planned, considered) = plan(
                    &problem,
                    &profile,
                    settings.strategy.as_deref(),
                    &settings.fixed,
                    copies.compute_seconds_per_byte,
                )?;
                (planned, considered, None)
            }
        };
        Ok(AutoSession {
            profile,
            planned,
            considered,
            copy,
            bandwidth,
            copy_cost: copies.compute_seconds_per_byte,
            budget: settings.budget,
            multiplexed,
        })
    }

    /// Runs one training step (recorded like the profiled one) by the plan.
    pub fn step(&self, graph: &mut Graph) -> anyhow::Result<StepReport> {
        Ok(run_plan(
            graph,
            &self.profile.layout,
            self.profile.graph.name(),
            &self.planned.plan,
            Some(&self.copy),
        )?)
    }

    /// Predicted against measured, for the end-of-run summary.
    pub fn summary(&self, reports: &[StepReport]) -> String {
        let peak = reports.iter().map(|r| r.peak_bytes).max().unwrap_or(0);
        let time = median(reports.iter().map(|r| r.step_time.as_secs_f64()).collect());
        let stall: f64 = reports.iter().map(|r| r.stall.as_secs_f64()).sum::<f64>()
            / reports.len().max(1) as f64;
        let r = &self.planned.report;
        let (kept, swapped, recomputed) = forward_bytes_by_fate(&self.profile.graph, r);
        let g = &self.profile.graph;
        [
            format!(
                "auto plan: strategy {} for a budget of {} (static {}, store-all peak {}), bandwidth {}, swaps cost {:.2} ms of compute per MiB",
                self.planned.plan.strategy,
                human_bytes(self.budget),
                human_bytes(g.static_bytes()),
                human_bytes(g.store_all_peak()),
                human_bandwidth(self.bandwidth),
                self.copy_cost * 1e3 * (1u64 << 20) as f64
            ),
            format!("  forward outputs (activations) kept {}, swapped {}, recomputed {} (each counted once)", human_bytes(kept), human_bytes(swapped), human_bytes(recomputed)),
            self.considered_line(),
            format!("  {:<10} {:>12} {:>12}", "", "predicted", "measured"),
            format!("  {:<10} {:>12} {:>12}", "peak MiB", mib(r.peak_bytes), mib(peak)),
            format!("  {:<10} {:>12.1} {:>12.1}", "step ms", r.total_time * 1e3, time * 1e3),
            format!("  {:<10} {:>12.1} {:>12.1}", "stall ms", r.stall_time * 1e3, stall * 1e3),
        ]
        .into_iter()
        .chain(self.multiplexed.iter().flat_map(|m| multiplexed::hiding_lines(m, 12)))
        .collect::<Vec<_>>()
        .join("\n")
    }
}

/// Bytes probed per copy when measuring the bandwidth under compute.
pub const PROBE_BYTES: usize = 8 << 20;

/// Bytes of the forward-pass outputs by what the plan does to them (kept, swapped,
/// recomputed). Gradient bundles, workspaces and gradient buffers are not activations.
pub fn forward_bytes_by_fate(
    graph: &remat_planner::Graph,
    report: &remat_planner::SimReport,
) -> (u64, u64, u64) {
    let mut sums = (0, 0, 0);
    for (id, fate) in report.fates.iter().enumerate() {
        let node = graph.node(id);
        if node.phase != remat_planner::Phase::Forward || !node.name.starts_with("fwd:") {
            continue;
        }
        match fate {
            remat_planner::sim::Fate::Kept => sums.0 += node.output_bytes,
            remat_planner::sim::Fate::Swapped => sums.1 += node.output_bytes,
            remat_planner::sim::Fate::Recomputed => sums.2 += node.output_bytes,
        }
    }
    sums
}

impl AutoSession {
    /// How many candidate plans were weighed and the runner-up.
    fn considered_line(&self) -> String {
        let mut fits: Vec<(&str, f64)> = self
            .considered
            .iter()
            .filter_map(|c| c.outcome.as_ref().ok().map(|&(t, _)| (c.name.as_str(), t)))
            .collect();
        fits.sort_by(|a, b| a.1.total_cmp(&b.1));
        let next = fits.get(1).map_or(String::new(), |(n, t)| {
            format!("; next fastest {n} ({:.1} ms)", t * 1e3)
        });
        format!(
            "  weighed {} candidate plans, {} fit the budget and run exactly{next}",
            self.considered.len(),
            fits.len()
        )
    }
}

/// Plans with one strategy or the fastest predicted of all (planner strategies and the
/// engine's fixed policies), among plans the executor runs; infeasible budgets name the
/// smallest peak.
pub fn plan(
    problem: &Problem,
    profile: &StepProfile,
    strategy: Option<&str>,
    fixed: &[(String, Vec<bool>)],
    copy_cost: f64,
) -> anyhow::Result<(Planned, Vec<Considered>)> {
    let result = choose_plan(problem, &profile.layout, strategy, fixed, copy_cost)
        .map(|choice| (choice.planned, choice.considered));
    result.map_err(|e| match e {
        PlanError::Infeasible { budget, best_peak, strategy } | PlanError::OverBudget { budget, best_peak, strategy } => {
            anyhow::anyhow!(
                "no plan fits a memory budget of {budget} bytes ({}): the smallest feasible budget is {best_peak} bytes ({}, reached by {strategy}); static memory alone is {}",
                human_bytes(budget),
                human_bytes(best_peak),
                human_bytes(problem.graph.static_bytes())
            )
        }
        other => anyhow::Error::from(other),
    })
}

/// The training loop of `remat train --policy auto[:STRATEGY]`.
pub fn run(args: &Args, task: &Task, strategy: Option<String>) -> anyhow::Result<()> {
    let budget = args.memory_budget.context(
        "--policy auto plans for a memory budget: give one with --memory-budget (e.g. 256MiB)",
    )?;
    let config = args.model_config(task.vocab());
    let n_layers = config.n_layers;
    println!(
        "remat train: {} | GPT L={} d={} heads={} ({} parameters) | batch {} x seq {} | policy auto{} | budget {} | {} threads",
        task.describe(),
        config.n_layers,
        config.d_model,
        config.n_heads,
        config.param_count(),
        args.batch,
        task.seq(),
        strategy
            .as_deref()
            .map_or(String::new(), |s| format!(":{s}")),
        human_bytes(budget),
        args.threads(),
    );
    // Profiling runs the step keeping everything, which may not fit: the budget is enforced
    // from the first planned step on.
    let pool = MemoryPool::unbounded();
    let ctx = ExecContext::new(pool.clone(), args.threads())?;
    let gpt = Gpt::new(&pool, config)?;
    if let Some(path) = &args.files.init {
        hf::load_params(&gpt, path)?;
    }
    let opt_config = AdamWConfig {
        lr: args.lr.one(),
        weight_decay: 0.0,
        ..AdamWConfig::default()
    };
    // Created before profiling: its state is static memory the plan must leave room for.
    let mut opt = AdamW::new(&pool, gpt.params(), opt_config)?;
    let settings = AutoSettings {
        budget,
        strategy,
        swap_dir: args.files.swap_dir.clone(),
        bandwidth: None,
        profile_runs: 5,
        fixed: Vec::new(),
    };
    let record = |step: u64| -> anyhow::Result<(Graph, Vec<NodeId>, NodeId)> {
        let mut g = Graph::new(&ctx);
        g.set_seed(args.seed.one() ^ (step << 32));
        let batch = task.batch(args.seed.one(), step, args.batch);
        let s = gpt.record(&mut g, &batch, Checkpointing::Graph(Policy::StoreAll))?;
        Ok((g, s.params, s.loss))
    };
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.set_message("profiling and planning the training step");
    spinner.enable_steady_tick(Duration::from_millis(120));
    let (mut g0, _, loss0) = record(0)?;
    let mut settings = settings;
    if settings.strategy.is_none() {
        let batch0 = task.batch(args.seed.one(), 0, args.batch);
        settings.fixed = fixed_policy_sets(&g0, &fixed_policies(n_layers), |ckpt| {
            let mut g = Graph::new(&ctx);
            gpt.record(&mut g, &batch0, ckpt)?;
            Ok(g)
        })?;
    }
    let session =
        AutoSession::prepare(&mut g0, loss0, &format!("gpt-train-l{n_layers}"), &settings);
    spinner.finish_and_clear();
    let session = session?;
    drop(g0);
    pool.set_budget(Some(budget));
    let bar = indicatif::ProgressBar::new(args.steps);
    let log_every = args.log_every.unwrap_or((args.steps / 15).max(1));
    let (mut losses, mut reports) = (Vec::new(), Vec::new());
    for step in 0..args.steps {
        let (mut g, params, _) = record(step)?;
        let report = session
            .step(&mut g)
            .with_context(|| format!("training step {step}"))?;
        let grads = params
            .iter()
            .map(|&p| g.take_grad(p))
            .collect::<Result<Vec<_>, _>>()?;
        drop(g);
        opt.step(&grads)?;
        let loss = report.loss.unwrap_or(f64::NAN);
        losses.push(loss);
        reports.push(report);
        bar.set_message(format!("{loss:.4}"));
        bar.inc(1);
        if step % log_every == 0 || step + 1 == args.steps {
            bar.suspend(|| println!("step {step:>5}  loss {loss:.4}"));
        }
    }
    bar.finish_and_clear();
    let n = losses.len();
    let window = (n / 10).clamp(1, 20).min(n.max(1));
    if n > 0 {
        let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
        println!(
            "loss: first {window} steps {:.4}, last {window} steps {:.4}",
            mean(&losses[..window]),
            mean(&losses[n - window..])
        );
    }
    // The first step pays one-off costs: time the rest, as `remat train` does.
    let timed = if reports.len() > 1 {
        &reports[1..]
    } else {
        &reports[..]
    };
    println!("{}", session.summary(timed));
    Ok(())
}
