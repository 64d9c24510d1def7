//! `remat bench plan`: every registered strategy on the shared graphs and on synthetic
//! graphs of ~350 and ~1,000 nodes.
//!
//! For each graph of `../shared/graphs` (or `--graphs DIR`) and each budget (0.9 ... 0.5 of
//! the store-all peak when above the floor, and 10%, 25%, 50% of the way from the floor to
//! the peak): each strategy's overhead (recompute + exposed swap over base time), its gap to
//! the best exact strategy that solved (the MILP with `--features milp`), and its solve time.
//! Then a summary of the best fast (non-exact) strategy against the exact optimum, and solve
//! times on the synthetic graphs.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use remat_planner::import::{ImportOptions, load};
use remat_planner::strategy::{Problem, Strategy, registry};
use remat_planner::{Graph, synth};

use super::plan::{human_bytes, parse_bandwidth, print_table};

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
    #[arg(long, default_value_t = 400)]
    pub exact_max_nodes: usize,
}

/// One strategy's result at one budget.
struct Outcome {
    name: String,
    exact: bool,
    overhead: Option<f64>,
    peak: Option<u64>,
    ms: f64,
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

fn run_all(problem: &Problem, strategies: &[Box<dyn Strategy>]) -> Vec<Outcome> {
    strategies
        .iter()
        .map(|s| {
            let started = Instant::now();
            let result = s.plan(problem);
            let ms = started.elapsed().as_secs_f64() * 1e3;
            let ok = result.ok();
            Outcome {
                name: s.name(),
                exact: s.is_exact(),
                overhead: ok.as_ref().map(|p| p.report.overhead()),
                peak: ok.as_ref().map(|p| p.report.peak_bytes),
                ms,
            }
        })
        .collect()
}

fn best(outcomes: &[Outcome], exact: bool) -> Option<&Outcome> {
    outcomes
        .iter()
        .filter(|o| o.exact == exact && o.overhead.is_some())
        .min_by(|a, b| {
            a.overhead
                .unwrap_or(f64::MAX)
                .total_cmp(&b.overhead.unwrap_or(f64::MAX))
        })
}

fn pct(x: f64) -> String {
    format!("{:.2}%", 100.0 * x)
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let bandwidth = parse_bandwidth(&args.bandwidth)?;
    let options = ImportOptions {
        time_unit_s: args.time_unit,
    };
    let strategies = registry();
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
            let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
                .with_context(|| format!("{}: cannot list", dir.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "json"))
                .collect();
            files.sort();
            for file in files {
                let graph = load(&file, options)?;
                summary.extend(bench_graph(&graph, &strategies, bandwidth));
            }
        }
        None => println!("no ../shared/graphs found (give --graphs DIR): shared graphs skipped"),
    }
    if !summary.is_empty() {
        println!("\nbest fast strategy against the exact optimum");
        print_table(
            &[
                "graph",
                "budget",
                "best fast",
                "overhead",
                "best exact",
                "overhead",
                "gap (points)",
                "ratio",
            ],
            &summary,
        );
    }
    bench_sizes(&strategies, bandwidth, args.exact_max_nodes);
    Ok(())
}

/// One table for the graph; returns its summary rows.
fn bench_graph(
    graph: &Graph,
    strategies: &[Box<dyn Strategy>],
    bandwidth: f64,
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
                let o = run_all(&problem, std::slice::from_ref(s));
                bar.inc(1);
                o.into_iter().next()
            })
            .collect::<Option<Vec<_>>>()
            .unwrap_or_default();
        let exact = best(&outcomes, true).and_then(|o| o.overhead);
        for o in &outcomes {
            let vs = match (o.overhead, exact) {
                (Some(x), Some(e)) => format!("{:+.2}", 100.0 * (x - e)),
                _ => "-".into(),
            };
            rows.push(vec![
                format!("{label} ({})", human_bytes(*budget)),
                o.name.clone(),
                o.overhead.map_or("infeasible".into(), pct),
                o.peak.map_or("-".into(), human_bytes),
                vs,
                format!("{:.1}", o.ms),
            ]);
        }
        let fast = best(&outcomes, false);
        let exact_best = best(&outcomes, true);
        summary.push(vec![
            short.clone(),
            label.clone(),
            fast.map_or("-".into(), |o| o.name.clone()),
            fast.and_then(|o| o.overhead).map_or("-".into(), pct),
            exact_best.map_or("-".into(), |o| o.name.clone()),
            exact.map_or("-".into(), pct),
            match (fast.and_then(|o| o.overhead), exact) {
                (Some(f), Some(e)) => format!("{:+.2}", 100.0 * (f - e)),
                _ => "-".into(),
            },
            match (fast.and_then(|o| o.overhead), exact) {
                (Some(f), Some(e)) if e > 0.0 => format!("{:.3}", (1.0 + f) / (1.0 + e)),
                _ => "-".into(),
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
        &[
            "budget",
            "strategy",
            "overhead",
            "peak",
            "vs exact (points)",
            "solve ms",
        ],
        &rows,
    );
    summary
}

/// Solve times on synthetic graphs of ~350 and ~1,000 nodes at the middle budget.
fn bench_sizes(strategies: &[Box<dyn Strategy>], bandwidth: f64, exact_max_nodes: usize) {
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
            if s.is_exact() && graph.len() > exact_max_nodes {
                column.push("skipped (exact)".to_string());
                continue;
            }
            let o = run_all(&problem, std::slice::from_ref(s));
            let cell = o.first().map_or("-".into(), |o| {
                format!(
                    "{:.1} ms ({})",
                    o.ms,
                    o.overhead.map_or("infeasible".into(), pct)
                )
            });
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
        &headers.iter().map(String::as_str).collect::<Vec<_>>(),
        &rows,
    );
}
