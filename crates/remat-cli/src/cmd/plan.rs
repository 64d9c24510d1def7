//! `remat plan GRAPH --budget ...`: plan keep/swap/recompute for a graph under a budget.
//!
//! One strategy (`--strategy`, default: the fastest plan of all strategies that fits)
//! prints the plan's peak, time overhead and bytes kept, swapped and recomputed, and writes
//! it with `--out`; `--compare` prints one table of every strategy at each budget; `--plot`
//! draws the plan's memory timeline against store-all's and the budget line.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use remat_planner::import::{ImportOptions, load};
use remat_planner::plot::{Chart, Series};
use remat_planner::strategy::{Planned, Problem, Strategy, lookup, plan_best, registry};
use remat_planner::{Graph, PlanError};

#[derive(clap::Args)]
pub struct Args {
    /// Graph file: remat's JSON schema or networkx node-link JSON (Checkmate graphs).
    pub graph: PathBuf,
    /// Device budget: bytes (`8GiB`, `500MB`, `1234`) or a fraction of the store-all peak
    /// (`0.7`). Several, comma-separated, with --compare.
    #[arg(long, value_delimiter = ',', required = true)]
    pub budget: Vec<String>,
    /// Strategy name (see --list); default: the fastest plan that fits among all.
    #[arg(long)]
    pub strategy: Option<String>,
    /// Host-device bandwidth, each direction (`32GB/s`, `16GiB/s`, bytes per second).
    #[arg(long, default_value = "32GB/s")]
    pub bandwidth: String,
    /// Seconds per unit of the graph's compute costs, for unitless networkx graphs.
    #[arg(long, default_value_t = 1e-6)]
    pub time_unit: f64,
    /// Write the plan as JSON.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Compare every strategy at the budget(s) in one table.
    #[arg(long)]
    pub compare: bool,
    /// Draw the memory timeline (`.svg` or `.png`).
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let options = ImportOptions {
        time_unit_s: args.time_unit,
    };
    let graph = load(&args.graph, options)?;
    let bandwidth = parse_bandwidth(&args.bandwidth)?;
    let budgets = args
        .budget
        .iter()
        .map(|b| parse_budget(b, &graph))
        .collect::<anyhow::Result<Vec<u64>>>()?;
    println!(
        "graph {}: {} nodes, store-all peak {}, floor {}",
        graph.name(),
        graph.len(),
        human_bytes(graph.store_all_peak()),
        human_bytes(graph.memory_floor())
    );
    if args.compare {
        return compare(&graph, &budgets, bandwidth);
    }
    let [budget] = budgets[..] else {
        bail!(
            "give one --budget without --compare (got {})",
            budgets.len()
        );
    };
    let problem = Problem {
        graph: &graph,
        budget_bytes: budget,
        bandwidth,
    };
    let planned = match &args.strategy {
        Some(name) => lookup(name)?.plan(&problem),
        None => plan_best(&problem),
    }
    .map_err(explain_infeasible)?;
    print_summary(&graph, &planned);
    if let Some(path) = &args.out {
        write_atomic(path, planned.plan.to_json().as_bytes())?;
        println!("plan written to {}", path.display());
    }
    if let Some(path) = &args.plot {
        plot(&problem, &planned, path)?;
        println!("timeline drawn to {}", path.display());
    }
    Ok(())
}

fn explain_infeasible(err: PlanError) -> anyhow::Error {
    match err {
        PlanError::Infeasible {
            budget,
            best_peak,
            strategy,
        } => anyhow::anyhow!(
            "budget {} is infeasible for every strategy: the smallest peak reached is {} (by {strategy})",
            human_bytes(budget),
            human_bytes(best_peak)
        ),
        other => other.into(),
    }
}

fn print_summary(graph: &Graph, planned: &Planned) {
    let r = &planned.report;
    let (kept, swapped, recomputed) = r.bytes_by_fate(graph);
    println!("strategy      {}", planned.plan.strategy);
    println!(
        "peak          {} ({:.1}% of store-all), budget {}",
        human_bytes(r.peak_bytes),
        100.0 * r.peak_bytes as f64 / graph.store_all_peak() as f64,
        human_bytes(planned.plan.budget_bytes)
    );
    println!(
        "time overhead {:.2}% (recompute {:.4} s, exposed swap {:.4} s, base {:.4} s)",
        100.0 * r.overhead(),
        r.recompute_time * graph.time_unit_s(),
        r.stall_time * graph.time_unit_s(),
        r.base_time * graph.time_unit_s()
    );
    println!(
        "bytes         kept {}, swapped {}, recomputed {}",
        human_bytes(kept),
        human_bytes(swapped),
        human_bytes(recomputed)
    );
}

/// One row of the comparison: the strategy's result at one budget.
fn compare(graph: &Graph, budgets: &[u64], bandwidth: f64) -> anyhow::Result<()> {
    let peak = graph.store_all_peak() as f64;
    let header = [
        "budget",
        "strategy",
        "peak",
        "peak/store-all",
        "overhead",
        "recompute",
        "swap exposed",
        "kept",
        "swapped",
        "recomputed",
        "solve ms",
    ];
    let mut rows = Vec::new();
    for &budget in budgets {
        let problem = Problem {
            graph,
            budget_bytes: budget,
            bandwidth,
        };
        for strategy in registry() {
            let started = Instant::now();
            let result = strategy.plan(&problem);
            let ms = started.elapsed().as_secs_f64() * 1e3;
            let budget_cell = format!("{} ({:.2})", human_bytes(budget), budget as f64 / peak);
            rows.push(compare_row(
                graph,
                budget_cell,
                strategy.as_ref(),
                result,
                ms,
                peak,
            ));
        }
    }
    print_table(&header, &rows);
    Ok(())
}

fn compare_row(
    graph: &Graph,
    budget: String,
    strategy: &dyn Strategy,
    result: Result<Planned, PlanError>,
    ms: f64,
    store_all: f64,
) -> Vec<String> {
    let mut row = vec![budget, strategy.name()];
    match result {
        Ok(p) => {
            let r = &p.report;
            let (kept, swapped, recomputed) = r.bytes_by_fate(graph);
            row.extend([
                human_bytes(r.peak_bytes),
                format!("{:.3}", r.peak_bytes as f64 / store_all),
                format!("{:.2}%", 100.0 * r.overhead()),
                format!(
                    "{:.2}%",
                    100.0 * r.recompute_time / r.base_time.max(f64::MIN_POSITIVE)
                ),
                format!(
                    "{:.2}%",
                    100.0 * r.stall_time / r.base_time.max(f64::MIN_POSITIVE)
                ),
                human_bytes(kept),
                human_bytes(swapped),
                human_bytes(recomputed),
            ]);
        }
        Err(PlanError::OverBudget { best_peak, .. }) => {
            row.extend([
                format!("over: {}", human_bytes(best_peak)),
                format!("{:.3}", best_peak as f64 / store_all),
            ]);
            row.extend(std::iter::repeat_n("-".to_string(), 6));
        }
        Err(other) => {
            row.push(format!("error: {other}"));
            row.extend(std::iter::repeat_n(String::new(), 7));
        }
    }
    row.push(format!("{ms:.1}"));
    row
}

/// Prints rows under a header, columns padded to their widest cell.
pub fn print_table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if i < widths.len() {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
    }
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        println!("| {} |", padded.join(" | "));
    };
    line(header.to_vec());
    println!(
        "|{}|",
        widths
            .iter()
            .map(|w| "-".repeat(w + 2))
            .collect::<Vec<_>>()
            .join("|")
    );
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}

fn plot(problem: &Problem, planned: &Planned, path: &Path) -> anyhow::Result<()> {
    let graph = problem.graph;
    let store_all = lookup("store-all")?.plan(&Problem {
        budget_bytes: u64::MAX,
        ..*problem
    })?;
    let unit = graph.time_unit_s();
    let points = |p: &Planned| {
        p.report
            .timeline
            .iter()
            .map(|t| (t.time * unit, t.bytes as f64))
            .collect::<Vec<_>>()
    };
    let chart = Chart {
        title: format!(
            "{}: {} at budget {}",
            graph.name(),
            planned.plan.strategy,
            human_bytes(problem.budget_bytes)
        ),
        x_label: "time (s)".into(),
        y_label: "device memory (bytes)".into(),
        series: vec![
            Series::new("store-all", points(&store_all), [150, 150, 150]),
            Series::new(&planned.plan.strategy, points(planned), [31, 119, 180]),
        ],
        hline: Some(("budget".into(), problem.budget_bytes as f64, [214, 39, 40])),
    };
    let bytes = match path.extension().and_then(|e| e.to_str()) {
        Some("svg") => chart.to_svg().into_bytes(),
        Some("png") => chart.to_png(1200, 600)?,
        _ => bail!("{}: --plot needs a .svg or .png file name", path.display()),
    };
    write_atomic(path, &bytes)
}

/// Writes to a temporary name beside `path`, syncs, renames.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    let name = path
        .file_name()
        .with_context(|| format!("{}: not a file name", path.display()))?;
    let tmp = path.with_file_name(format!(".{}.tmp", name.to_string_lossy()));
    let mut file =
        std::fs::File::create(&tmp).with_context(|| format!("{}: cannot create", tmp.display()))?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .with_context(|| format!("{}: cannot write", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("{}: cannot rename", path.display()))
}

/// `0.7` (fraction of the store-all peak), `8GiB`, `500MB`, `1234`.
pub fn parse_budget(text: &str, graph: &Graph) -> anyhow::Result<u64> {
    let t = text.trim();
    if let Ok(f) = t.parse::<f64>()
        && t.contains('.')
    {
        if !(f > 0.0 && f <= 1.0) {
            bail!("--budget {t}: a fraction must be in (0, 1]");
        }
        return Ok((graph.store_all_peak() as f64 * f) as u64);
    }
    parse_bytes(t).with_context(|| format!("--budget {t}"))
}

/// `32GB/s`, `16GiB/s`, `1e9`: bytes per second.
pub fn parse_bandwidth(text: &str) -> anyhow::Result<f64> {
    let t = text.trim().trim_end_matches("/s");
    let bytes = parse_bytes(t).with_context(|| format!("--bandwidth {text}"))?;
    if bytes == 0 {
        bail!("--bandwidth {text}: must be positive");
    }
    Ok(bytes as f64)
}

fn parse_bytes(text: &str) -> anyhow::Result<u64> {
    let split = text
        .find(|c: char| c.is_ascii_alphabetic())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .trim()
        .parse()
        .with_context(|| format!("`{number}` is not a number"))?;
    let scale = match unit.trim() {
        "" | "B" => 1.0,
        "KB" | "kB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        "TiB" => 1024f64.powi(4),
        other => bail!("unknown unit `{other}` (use B, KB, MB, GB, KiB, MiB, GiB)"),
    };
    if !(value.is_finite() && value >= 0.0) {
        bail!("`{number}` is not a non-negative number");
    }
    Ok((value * scale).round() as u64)
}

pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}
