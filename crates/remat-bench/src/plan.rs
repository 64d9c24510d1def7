//! `remat bench plan`: every registered strategy on the shared graphs and on synthetic
//! graphs of ~350 and ~1,000 nodes.
//!
//! For each graph of `../shared/graphs` (or `--graphs DIR`) and each budget (0.9 ... 0.5 of
//! the store-all peak when above the floor, and 10%, 25%, 50% of the way from the floor to
//! the peak): each strategy's overhead (recompute + exposed swap over base time), its ratio
//! to the exact optimum's overhead, and its solve time. The exact reference is the best plan
//! of a strategy that is exact *for that problem* ([`Strategy::is_exact_for`]): Checkmate's
//! MILP when the binary is built with `--features milp`, and `chain-dp` only where its
//! memory units are lossless. Then a summary of the best fast (non-exact) strategy against
//! that optimum with a pass/fail column for the goal (fast overhead within 2% of the
//! optimal overhead), and solve times on the synthetic graphs.
//!
//! Then the near-the-floor section ([`near_floor`]) and the scale section ([`scale`]): the
//! default search, `evict` and `mutwo` on random layered graphs of 250-5,000 nodes, on
//! transformers of 1,000-10,000, on Moccasin's files of 250 nodes up (at the paper's budgets).

pub mod multi;
pub mod near_floor;
pub mod scale;

use std::path::{Path, PathBuf};
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use remat_planner::import::{ImportOptions, load};
use remat_planner::{Graph, PlanError, synth};
use remat_planner::{Planned, Problem, Strategy, registry};
use remat_report::{Layout, print_table};
use remat_units::human_bytes;

use crate::error::{BenchError, Context, Result, bail};

#[derive(clap::Args)]
pub struct Args {
    /// Folder of graphs (default: ../shared/graphs beside the checkout, or
    /// $REMAT_SHARED_DIR/graphs).
    #[arg(long)]
    pub graphs: Option<PathBuf>,
    /// Host-device bandwidth, each direction.
    #[arg(long, default_value = "32GB/s")]
    pub bandwidth: String,
    /// Seconds per unit of the graphs' compute costs.
    #[arg(long, default_value_t = 1e-6)]
    pub time_unit: f64,
    /// Exact strategies run on synthetic graphs up to this many nodes (they are not meant
    /// to be fast; the MILP would take hours on 1,000 nodes).
    #[arg(long, default_value_t = 400, value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    pub exact_max_nodes: usize,
    /// Only the shared graphs whose file name contains this text.
    #[arg(long)]
    pub only: Option<String>,
    /// Seconds HiGHS may spend per budget (feature `milp`). A schedule it cannot prove
    /// optimal in that time is shown as its incumbent with the proved bound, and is not
    /// the reference.
    #[arg(long, default_value_t = 120.0, value_parser = remat_units::flag::seconds, allow_hyphen_values = true)]
    pub milp_time_limit: f64,
    /// Seconds after which a solve of the scale section is stopped (reported as such): 3x
    /// the default search's own limit at 10,000 nodes, so only strategies without a time
    /// limit (evict, mutwo on the larger random layered graphs) are stopped.
    #[arg(long, default_value_t = 30.0)]
    pub scale_cap: f64,
    /// Scale-section graphs above this many nodes are left out.
    #[arg(long, default_value_t = 10_000, value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    pub scale_max_nodes: usize,
    /// Only the scale section.
    #[arg(long)]
    pub scale_only: bool,
    /// Skip the scale section.
    #[arg(long, conflicts_with = "scale_only")]
    pub no_scale: bool,
    /// Only the multi-model table: K = 1, 2, 4 copies of a synthetic transformer planned
    /// together, interleaved against one after another and each alone.
    #[arg(long, conflicts_with_all = ["scale_only", "scale_worker"])]
    pub multi: bool,
    /// With --multi: the budget as a multiple of one model's store-all peak.
    #[arg(long, default_value_t = 1.1)]
    pub multi_budget: f64,
    /// With --multi: layers of the synthetic transformer (`synth::TransformerParams::gpt`).
    #[arg(long, default_value_t = 2, value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    pub multi_layers: usize,
    /// Only the near-the-floor section.
    #[arg(long, conflicts_with_all = ["scale_only", "scale_worker", "multi"])]
    pub near_floor: bool,
    /// Seconds each solve of the near-the-floor section may take (default: the planner's
    /// own for the graph, as `remat plan` gives it: 1 s up to 1,000 nodes, 1 ms per node
    /// above).
    #[arg(long, value_parser = remat_units::flag::seconds, allow_hyphen_values = true)]
    pub near_floor_time_limit: Option<f64>,
    /// With --near-floor: only the graphs whose label contains this text, in any case
    /// ("32 layers, eager", "moccasin n=500"), to reproduce one row quickly.
    #[arg(long, requires = "near_floor")]
    pub near_floor_only: Option<String>,
    /// Skip the near-the-floor section.
    #[arg(long, conflicts_with = "near_floor")]
    pub no_near_floor: bool,
    /// Internal: run one solve of the scale section (SPEC|BUDGET|SOLVER) and print it.
    #[arg(long, hide = true)]
    pub scale_worker: Option<String>,
}

/// The overhead goal: the best fast strategy within this factor of the optimal overhead.
const GOAL: f64 = 1.02;

/// One strategy's result at one budget.
struct Outcome {
    name: String,
    /// The plan is optimal for this problem (the reference).
    exact: bool,
    /// (overhead, peak), or the cell to show instead.
    result: Result<(f64, u64), &'static str>,
    ms: f64,
}

impl Outcome {
    fn overhead(&self) -> Option<f64> {
        self.result.as_ref().ok().map(|r| r.0)
    }
    fn cell(&self) -> String {
        match self.result {
            Ok((overhead, _)) => pct(overhead),
            Err(label) => label.to_string(),
        }
    }
}

/// The table label of a strategy that produced no plan: infeasible only when it says the
/// budget cannot be met, "n/a" when it does not apply to the graph.
fn failure_label(err: &PlanError) -> &'static str {
    match err {
        PlanError::OverBudget { .. } | PlanError::Infeasible { .. } => "infeasible",
        PlanError::ProvedInfeasible { .. } => "infeasible (proved)",
        PlanError::NotApplicable { .. } => "n/a",
        _ => "error",
    }
}

fn graphs_dir(arg: &Option<PathBuf>) -> Option<PathBuf> {
    if let Some(dir) = arg {
        return Some(dir.clone());
    }
    let beside = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/graphs"
    ));
    let env = std::env::var_os("REMAT_SHARED_DIR").map(|d| PathBuf::from(d).join("graphs"));
    [Some(beside), env, Some(PathBuf::from("../shared/graphs"))]
        .into_iter()
        .flatten()
        .find(|d| d.is_dir())
}

/// The budgets of the issue, in bytes, with their labels.
fn budgets(graph: &Graph) -> Vec<(String, u64)> {
    let (floor, peak) = (graph.memory_floor(), graph.store_all_peak());
    let mut out = Vec::new();
    for f in [0.9, 0.8, 0.7, 0.6, 0.5] {
        let b = (peak as f64 * f) as u64;
        if b >= floor {
            out.push((format!("{f:.1} peak"), b));
        }
    }
    for f in [0.10, 0.25, 0.50] {
        let b = floor + ((peak - floor) as f64 * f) as u64;
        out.push((format!("floor+{:.0}%", f * 100.0), b));
    }
    out
}

fn run_all(problem: &Problem, strategies: &[Box<dyn Strategy>], milp_limit: f64) -> Vec<Outcome> {
    strategies
        .iter()
        .map(|s| {
            let started = Instant::now();
            let (name, result, exact) = plan_one(s.as_ref(), problem, milp_limit);
            let ms = started.elapsed().as_secs_f64() * 1e3;
            Outcome {
                name,
                exact,
                result: result
                    .as_ref()
                    .map(|p| (p.report.overhead(), p.report.peak_bytes))
                    .map_err(failure_label),
                ms,
            }
        })
        .collect()
}

/// One strategy's plan, its table name, and whether the plan is the problem's optimum. The
/// MILP's plan may be an incumbent HiGHS did not prove optimal in time: it is then not the
/// reference, and its name shows the bound HiGHS proved.
fn plan_one(
    s: &dyn Strategy,
    problem: &Problem,
    milp_limit: f64,
) -> (String, Result<Planned, PlanError>, bool) {
    #[cfg(feature = "milp")]
    if s.name() == remat_planner::exact::milp::NAME {
        let milp = remat_planner::exact::milp::CheckmateMilp {
            options: remat_planner::exact::milp::MilpOptions {
                time_limit_s: milp_limit,
                ..Default::default()
            },
        };
        return match milp.solve(problem) {
            Ok(outcome) => {
                let bound = pct(outcome.lower_bound_overhead(problem.graph));
                let exact = outcome.proved_optimal;
                let name = match (&outcome.planned, exact) {
                    (_, true) => s.name(),
                    (Some(_), false) => {
                        format!(
                            "{} (incumbent; recompute-only optimum >= {bound})",
                            s.name()
                        )
                    }
                    (None, false) => {
                        format!(
                            "{} (none in time; recompute-only optimum >= {bound})",
                            s.name()
                        )
                    }
                };
                let result = outcome.planned.ok_or_else(|| PlanError::NotApplicable {
                    strategy: s.name(),
                    why: "no schedule in time".into(),
                });
                (name, result, exact)
            }
            Err(e) => (s.name(), Err(e), false),
        };
    }
    let _ = milp_limit;
    let result = s.plan(problem);
    let exact = s.is_exact_for(problem) && result.is_ok();
    (s.name(), result, exact)
}

fn best(outcomes: &[Outcome], exact: bool) -> Option<&Outcome> {
    outcomes
        .iter()
        .filter(|o| o.exact == exact && o.overhead().is_some())
        .min_by(|a, b| {
            a.overhead()
                .unwrap_or(f64::MAX)
                .total_cmp(&b.overhead().unwrap_or(f64::MAX))
        })
}

/// Fast overhead over exact overhead, the measure of the 2% goal ("-" when the optimum has
/// no overhead: the goal is then met only by no overhead at all).
fn ratio_cell(fast: f64, exact: f64) -> String {
    if exact > 0.0 {
        format!("{:.4}", fast / exact)
    } else {
        "-".into()
    }
}

fn meets_goal(fast: f64, exact: f64) -> bool {
    // An absolute 1e-9 absorbs float noise when both overheads are zero.
    fast <= exact * GOAL + 1e-9
}

fn pct(x: f64) -> String {
    format!("{:.2}%", 100.0 * x)
}

/// The strategies to bench: the registry, with the MILP's time limit from the command line.
#[cfg(feature = "milp")]
fn strategies(args: &Args) -> Vec<Box<dyn Strategy>> {
    use remat_planner::exact::milp::{CheckmateMilp, MilpOptions, NAME};
    registry()
        .into_iter()
        .map(|s| -> Box<dyn Strategy> {
            if s.name() == NAME {
                Box::new(CheckmateMilp {
                    options: MilpOptions {
                        time_limit_s: args.milp_time_limit,
                        ..MilpOptions::default()
                    },
                })
            } else {
                s
            }
        })
        .collect()
}

#[cfg(not(feature = "milp"))]
fn strategies(_args: &Args) -> Vec<Box<dyn Strategy>> {
    registry()
}

pub fn run(args: Args) -> Result<()> {
    let bandwidth = remat_units::parse_bandwidth(&args.bandwidth, "--bandwidth")?;
    let options = ImportOptions {
        time_unit_s: args.time_unit,
    };
    if let Some(work) = &args.scale_worker {
        return scale::worker(work, bandwidth, options);
    }
    if args.scale_only {
        return run_scale(&args, options);
    }
    if args.multi {
        if !(args.multi_budget.is_finite() && args.multi_budget > 0.0) {
            bail!(
                "--multi-budget {}: give a positive multiple of one model's peak",
                args.multi_budget
            );
        }
        if args.multi_layers == 0 {
            bail!("--multi-layers 0: give at least one layer");
        }
        return multi::run(&multi::MultiBench {
            layers: args.multi_layers,
            budget_of_one: args.multi_budget,
            bandwidth,
            time_limit: std::time::Duration::from_secs(1),
        });
    }
    let mut near_floor = near_floor::NearFloorBench::new(args.near_floor_time_limit, bandwidth)?;
    near_floor.only = args.near_floor_only.clone();
    if args.near_floor {
        return near_floor::run(&near_floor);
    }
    let strategies = strategies(&args);
    if !cfg!(feature = "milp") {
        println!(
            "built without --features milp: the exact reference is chain-dp where its memory units are lossless, which real graphs rarely allow; build with `cargo build --release -p remat-cli --features milp` for Checkmate's MILP"
        );
    }
    println!(
        "strategies: {}",
        strategies
            .iter()
            .map(|s| s.name())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let mut summary = Vec::new();
    match graphs_dir(&args.graphs) {
        Some(dir) => {
            let graphs = load_graphs(&dir, args.only.as_deref(), options)?;
            for graph in &graphs {
                summary.extend(bench_graph(
                    graph,
                    &strategies,
                    bandwidth,
                    args.milp_time_limit,
                ));
            }
        }
        None => println!("no ../shared/graphs found (give --graphs DIR): shared graphs skipped"),
    }
    if !summary.is_empty() {
        println!("\nbest fast strategy against the exact optimum");
        print_table(
            Layout::Markdown,
            &[
                "graph",
                "budget",
                "best fast",
                "overhead",
                "best exact",
                "overhead",
                "fast/exact overhead",
                "within 2%",
            ],
            &summary,
        );
    }
    bench_sizes(
        &strategies,
        bandwidth,
        args.exact_max_nodes,
        args.milp_time_limit,
    );
    if !args.no_near_floor {
        near_floor::run(&near_floor)?;
    }
    if !args.no_scale {
        run_scale(&args, options)?;
    }
    Ok(())
}

fn run_scale(args: &Args, import: ImportOptions) -> Result<()> {
    if !(args.scale_cap.is_finite() && args.scale_cap > 0.0) {
        bail!(
            "--scale-cap {}: give a positive number of seconds",
            args.scale_cap
        );
    }
    let dir = graphs_dir(&args.graphs);
    scale::run(&scale::ScaleOptions {
        graphs: dir.as_deref(),
        bandwidth: &args.bandwidth,
        time_unit: args.time_unit,
        cap_s: args.scale_cap,
        max_nodes: args.scale_max_nodes,
        import,
    })
}

/// Every `.json` graph of `dir` whose file name contains `only`, in name order, loaded and
/// validated before any benching: a bad graph is reported at once, not after minutes of
/// benching the ones sorting before it. `--only` matching no file is an error listing the
/// files there are.
fn load_graphs(dir: &Path, only: Option<&str>, options: ImportOptions) -> Result<Vec<Graph>> {
    let mut all: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("{}: cannot list", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        // Moccasin's large published files are benched in the scale section.
        .filter(|p| !scale::is_scale_file(p))
        .collect();
    all.sort();
    let name = |p: &PathBuf| {
        p.file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().to_string())
    };
    let files: Vec<&PathBuf> = all
        .iter()
        .filter(|p| only.is_none_or(|only| name(p).contains(only)))
        .collect();
    if files.is_empty() {
        let names: Vec<String> = all.iter().map(name).collect();
        match only {
            Some(only) => bail!(
                "--only {only}: no graph file in {} has `{only}` in its name; there are: {}",
                dir.display(),
                if names.is_empty() {
                    "none".to_string()
                } else {
                    names.join(", ")
                }
            ),
            None => bail!("{}: no .json graph files", dir.display()),
        }
    }
    files
        .into_iter()
        .map(|file| load(file, options).map_err(BenchError::from))
        .collect()
}

/// One table for the graph; returns its summary rows.
fn bench_graph(
    graph: &Graph,
    strategies: &[Box<dyn Strategy>],
    bandwidth: f64,
    milp_limit: f64,
) -> Vec<Vec<String>> {
    let budgets = budgets(graph);
    let bar = ProgressBar::new((budgets.len() * strategies.len()) as u64);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(graph.name().to_string());
    let mut rows = Vec::new();
    let mut summary = Vec::new();
    let short = graph
        .name()
        .split_whitespace()
        .next()
        .unwrap_or("")
        .to_string();
    for (label, budget) in &budgets {
        let problem = Problem {
            graph,
            budget_bytes: *budget,
            bandwidth,
        };
        let outcomes: Vec<Outcome> = strategies
            .iter()
            .map(|s| {
                let o = run_all(&problem, std::slice::from_ref(s), milp_limit);
                bar.inc(1);
                o.into_iter().next()
            })
            .collect::<Option<Vec<_>>>()
            .unwrap_or_default();
        let exact = best(&outcomes, true).and_then(Outcome::overhead);
        for o in &outcomes {
            let vs = match (o.overhead(), exact) {
                (Some(x), Some(e)) => ratio_cell(x, e),
                _ => "-".into(),
            };
            rows.push(vec![
                format!("{label} ({})", human_bytes(*budget)),
                format!("{}{}", o.name, if o.exact { " (exact)" } else { "" }),
                o.cell(),
                o.result
                    .as_ref()
                    .map_or("-".into(), |&(_, peak)| human_bytes(peak)),
                vs,
                format!("{:.1}", o.ms),
            ]);
        }
        let fast = best(&outcomes, false);
        let exact_best = best(&outcomes, true);
        let fast_overhead = fast.and_then(Outcome::overhead);
        summary.push(vec![
            short.clone(),
            label.clone(),
            fast.map_or("-".into(), |o| o.name.clone()),
            fast_overhead.map_or("-".into(), pct),
            exact_best.map_or("no exact plan".into(), |o| o.name.clone()),
            exact.map_or("-".into(), pct),
            match (fast_overhead, exact) {
                (Some(f), Some(e)) => ratio_cell(f, e),
                _ => "-".into(),
            },
            match (fast_overhead, exact) {
                (Some(f), Some(e)) if meets_goal(f, e) => "pass".into(),
                (Some(_), Some(_)) => "FAIL".into(),
                _ => "unknown".into(),
            },
        ]);
    }
    bar.finish_and_clear();
    println!(
        "\n{}: {} nodes, store-all peak {}, floor {}",
        graph.name(),
        graph.len(),
        human_bytes(graph.store_all_peak()),
        human_bytes(graph.memory_floor())
    );
    print_table(
        Layout::Markdown,
        &[
            "budget",
            "strategy",
            "overhead",
            "peak",
            "overhead / exact",
            "solve ms",
        ],
        &rows,
    );
    summary
}

/// Solve times on synthetic graphs of ~350 and ~1,000 nodes at the middle budget.
fn bench_sizes(
    strategies: &[Box<dyn Strategy>],
    bandwidth: f64,
    exact_max_nodes: usize,
    milp_limit: f64,
) {
    let graphs = [synth::training_graph(174, 7), synth::training_graph(500, 7)];
    let mut rows = Vec::new();
    let bar = ProgressBar::new((graphs.len() * strategies.len()) as u64);
    let mut per_graph: Vec<Vec<String>> = Vec::new();
    for graph in &graphs {
        let (floor, peak) = (graph.memory_floor(), graph.store_all_peak());
        let problem = Problem {
            graph,
            budget_bytes: floor + (peak - floor) / 2,
            bandwidth,
        };
        let mut column = Vec::new();
        for s in strategies {
            bar.inc(1);
            if s.is_exact_for(&problem) && graph.len() > exact_max_nodes {
                column.push("skipped (exact)".to_string());
                continue;
            }
            let o = run_all(&problem, std::slice::from_ref(s), milp_limit);
            let cell = o
                .first()
                .map_or("-".into(), |o| format!("{:.1} ms ({})", o.ms, o.cell()));
            column.push(cell);
        }
        per_graph.push(column);
    }
    bar.finish_and_clear();
    for (i, s) in strategies.iter().enumerate() {
        let mut row = vec![s.name()];
        row.extend(per_graph.iter().map(|c| c[i].clone()));
        rows.push(row);
    }
    println!("\nsolve time (overhead) at floor + 50%, synthetic training graphs");
    let headers = [
        "strategy".to_string(),
        format!("{} nodes", graphs[0].len()),
        format!("{} nodes", graphs[1].len()),
    ];
    print_table(
        Layout::Markdown,
        &headers.iter().map(String::as_str).collect::<Vec<_>>(),
        &rows,
    );
}

#[cfg(test)]
mod tests;
