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
    #[arg(required_unless_present = "list")]
    pub graph: Option<PathBuf>,
    /// Device budget: bytes (`8GiB`, `500MB`, `1234`) or a fraction of the store-all peak
    /// (`0.7`). Several, comma-separated, with --compare.
    #[arg(long, value_delimiter = ',', required_unless_present = "list")]
    pub budget: Vec<String>,
    /// List the strategies and exit.
    #[arg(long)]
    pub list: bool,
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
    if args.list {
        let rows: Vec<Vec<String>> = registry()
            .iter()
            .map(|s| {
                let kind = if s.is_exact() { "exact" } else { "heuristic" };
                vec![s.name(), kind.to_string(), s.summary().to_string()]
            })
            .collect();
        print_table(&["strategy", "kind", "what it does"], &rows);
        println!("parameterized: every:N, by-depth:D, threshold:F (fraction of activation bytes)");
        return Ok(());
    }
    let options = ImportOptions {
        time_unit_s: args.time_unit,
    };
    let Some(graph_path) = &args.graph else {
        bail!("give a GRAPH file");
    };
    let graph = load(graph_path, options)?;
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
        let ignored: Vec<&str> = [
            ("--strategy", args.strategy.is_some()),
            ("--out", args.out.is_some()),
            ("--plot", args.plot.is_some()),
        ]
        .iter()
        .filter_map(|&(flag, given)| given.then_some(flag))
        .collect();
        if !ignored.is_empty() {
            bail!(
                "--compare runs every strategy and writes nothing: it cannot take {}",
                ignored.join(", ")
            );
        }
        return compare(&graph, &budgets, bandwidth);
    }
    let [budget] = budgets[..] else {
        bail!(
            "give one --budget without --compare (got {})",
            budgets.len()
        );
    };
    let plot_format = args.plot.as_deref().map(plot_format).transpose()?;
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
    // Everything is produced in memory first, so a failure writes no file at all.
    let mut outputs = Vec::new();
    if let Some(path) = &args.out {
        outputs.push((
            path.clone(),
            planned.plan.to_json().into_bytes(),
            "plan written",
        ));
    }
    if let (Some(path), Some(format)) = (&args.plot, plot_format) {
        let bytes = plot(&problem, &planned, format)?;
        outputs.push((path.clone(), bytes, "timeline drawn"));
    }
    write_all_atomic(&outputs)?;
    for (path, _, what) in &outputs {
        println!("{what} to {}", path.display());
    }
    Ok(())
}

/// Image formats of `--plot`.
#[derive(Clone, Copy, Debug, PartialEq)]
enum PlotFormat {
    Svg,
    Png,
}

fn plot_format(path: &Path) -> anyhow::Result<PlotFormat> {
    match path.extension().and_then(|e| e.to_str()) {
        Some("svg") => Ok(PlotFormat::Svg),
        Some("png") => Ok(PlotFormat::Png),
        _ => bail!("{}: --plot needs a .svg or .png file name", path.display()),
    }
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
    let mut notes = Vec::new();
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
                &mut notes,
            ));
        }
    }
    print_table(&header, &rows);
    for (i, note) in notes.iter().enumerate() {
        println!("[{}] {note}", i + 1);
    }
    Ok(())
}

/// One row; a strategy without a plan gets "n/a [k]" and footnote k says why.
fn compare_row(
    graph: &Graph,
    budget: String,
    strategy: &dyn Strategy,
    result: Result<Planned, PlanError>,
    ms: f64,
    notes: &mut Vec<String>,
) -> Vec<String> {
    let store_all = graph.store_all_peak() as f64;
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
        Err(err) => {
            let why = match err {
                PlanError::OverBudget { best_peak, .. } => format!(
                    "over budget: its smallest peak is {} ({:.3} of store-all)",
                    human_bytes(best_peak),
                    best_peak as f64 / store_all
                ),
                other => other.to_string(),
            };
            notes.push(format!("{}: {why}", strategy.name()));
            row.push(format!("n/a [{}]", notes.len()));
            row.extend(std::iter::repeat_n("-".to_string(), 7));
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

fn plot(problem: &Problem, planned: &Planned, format: PlotFormat) -> anyhow::Result<Vec<u8>> {
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
    Ok(match format {
        PlotFormat::Svg => chart.to_svg().into_bytes(),
        PlotFormat::Png => chart.to_png(1200, 600)?,
    })
}

/// Writes every file to a temporary name beside it and syncs them all, then renames them
/// all: a failure while writing leaves no output file (temporaries are removed), and the
/// renames come only once every byte is on disk.
fn write_all_atomic(files: &[(PathBuf, Vec<u8>, &str)]) -> anyhow::Result<()> {
    let mut temps: Vec<PathBuf> = Vec::with_capacity(files.len());
    let result = (|| {
        for (path, bytes, _) in files {
            temps.push(write_temp(path, bytes)?);
        }
        for ((path, _, _), tmp) in files.iter().zip(&temps) {
            std::fs::rename(tmp, path)
                .with_context(|| format!("{}: cannot rename into place", path.display()))?;
        }
        Ok(())
    })();
    if result.is_err() {
        for tmp in &temps {
            let _ = std::fs::remove_file(tmp);
        }
    }
    result
}

fn write_temp(path: &Path, bytes: &[u8]) -> anyhow::Result<PathBuf> {
    use std::io::Write;
    let name = path
        .file_name()
        .with_context(|| format!("{}: not a file name", path.display()))?;
    let tmp = path.with_file_name(format!(".{}.tmp", name.to_string_lossy()));
    let mut file =
        std::fs::File::create(&tmp).with_context(|| format!("{}: cannot create", tmp.display()))?;
    if let Err(e) = file.write_all(bytes).and_then(|()| file.sync_all()) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("{}: cannot write", tmp.display()));
    }
    Ok(tmp)
}

/// `0.7` (fraction of the store-all peak), `8GiB`, `500MB`, `1234`, `1e9` (bytes).
/// A plain number with a decimal point and no exponent is a fraction.
pub fn parse_budget(text: &str, graph: &Graph) -> anyhow::Result<u64> {
    let t = text.trim();
    if let Ok(f) = t.parse::<f64>()
        && t.contains('.')
        && !t.contains(['e', 'E'])
    {
        if !(f > 0.0 && f <= 1.0) {
            bail!(
                "--budget {t}: a fraction must be in (0, 1]; give bytes with a unit (8GiB) or an integer"
            );
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

/// A number (scientific notation allowed) followed by an optional unit: the unit is the
/// trailing run of letters, so the `e` of `1e9` stays in the number.
fn parse_bytes(text: &str) -> anyhow::Result<u64> {
    let split = text
        .char_indices()
        .rev()
        .take_while(|(_, c)| c.is_ascii_alphabetic())
        .last()
        .map_or(text.len(), |(i, _)| i);
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
    let bytes = value * scale;
    if bytes >= u64::MAX as f64 {
        bail!("`{text}` is more than 2^64 bytes");
    }
    Ok(bytes.round() as u64)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_units_and_scientific_notation() {
        assert_eq!(parse_bytes("1e9").unwrap(), 1_000_000_000);
        assert_eq!(parse_bytes("1.5e3MB").unwrap(), 1_500_000_000);
        assert_eq!(parse_bytes("8GiB").unwrap(), 8 << 30);
        assert_eq!(parse_bandwidth("32GB/s").unwrap(), 32e9);
        assert_eq!(parse_bandwidth("1e9").unwrap(), 1e9);
        assert!(parse_bytes("3 parsecs").is_err());
        assert!(parse_bytes("1e30").is_err());
    }

    #[test]
    fn plot_needs_a_known_extension_before_anything_runs() {
        assert_eq!(plot_format(Path::new("x.svg")).unwrap(), PlotFormat::Svg);
        assert!(plot_format(Path::new("x.jpg")).is_err());
    }
}
