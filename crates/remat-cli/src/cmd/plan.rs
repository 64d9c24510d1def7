//! `remat plan GRAPH --budget ...`: plan keep/swap/recompute for a graph under a budget.
//!
//! One strategy (`--strategy`), or by default the anytime search (every strategy that can
//! finish in the time limit, then the `anytime` solver improving on the best until
//! `--time-limit`), prints the plan's peak, time overhead, a lower bound on the overhead of
//! any schedule and the gap to it, whether the operations were reordered, and bytes kept,
//! swapped and recomputed, and writes it with `--out`; `--compare` prints one table of every strategy at each budget; `--plot`
//! draws the plan's memory timeline against store-all's and the budget line.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use remat_planner::import::{ImportOptions, load};
use remat_planner::plot::{Chart, Series};
use remat_planner::solve::bound::{Bound, cover_bound};
use remat_planner::solve::{self, Anytime, check_floor, default_time_limit};
use remat_planner::strategy::baselines::PARAMETERIZED;
use remat_planner::strategy::{
    BestPlan, Planned, Problem, SearchProgress, Strategy, calibrate, lookup, plan_best_within,
    registry, skipped_in_search,
};
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
    /// Strategy name (see --list); default: the anytime search, the fastest plan found
    /// within --time-limit.
    #[arg(long)]
    pub strategy: Option<String>,
    /// Seconds the search may take (default: 1 s up to 1,000 nodes, 1 ms per node above).
    /// Also the limit of `--strategy anytime`, and each strategy's limit with --compare.
    #[arg(long)]
    pub time_limit: Option<f64>,
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
        println!("parameterized: {PARAMETERIZED}");
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
    let time_limit = match args.time_limit {
        Some(s) if s.is_finite() && s > 0.0 && s <= 1e6 => Duration::from_secs_f64(s),
        Some(s) => bail!("--time-limit {s}: give a number of seconds above 0 (at most 1e6)"),
        None => default_time_limit(graph.len()),
    };
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
        return compare(&graph, &budgets, bandwidth, time_limit);
    }
    let [budget] = budgets[..] else {
        bail!(
            "give one --budget without --compare (got {})",
            budgets.len()
        );
    };
    let plot_format = args.plot.as_deref().map(plot_format).transpose()?;
    // Output paths are checked before planning, which can take minutes: a typo in a
    // directory, a device or a directory as target, or one path given twice is told now.
    let targets: Vec<&Path> = [args.out.as_deref(), args.plot.as_deref()]
        .into_iter()
        .flatten()
        .collect();
    check_outputs(&targets)?;
    let problem = Problem {
        graph: &graph,
        budget_bytes: budget,
        bandwidth,
    };
    check_floor(&problem)?;
    let started = Instant::now();
    let (planned, bound) = match &args.strategy {
        Some(name) => {
            let strategy = strategy_named(name, time_limit)?;
            let planned = strategy.plan(&problem).map_err(explain_infeasible)?;
            // The bound climbs for a tenth of the time the plan took, at least 0.1 s.
            let spent = started.elapsed().max(Duration::from_secs(1)) / 10;
            let bound = cover_bound(
                &problem,
                Instant::now() + spent,
                Some(planned.report.overhead()),
            );
            (planned, Some(bound))
        }
        None => {
            let (result, bound) = best_with_progress(&problem, time_limit);
            (result.map_err(explain_infeasible)?, bound)
        }
    };
    print_summary(&graph, &planned);
    print_bound(&planned, bound.as_ref(), started.elapsed());
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

/// `--strategy NAME`, with `anytime` taking the time limit.
fn strategy_named(name: &str, limit: Duration) -> anyhow::Result<Box<dyn Strategy>> {
    if name == solve::NAME {
        return Ok(Box::new(Anytime {
            time_limit: Some(limit),
        }));
    }
    Ok(lookup(name)?)
}

/// The anytime search, with a progress bar once it has run for a second, then a note for
/// each strategy that was skipped (too slow for the time left, or not applicable) or failed.
fn best_with_progress(
    problem: &Problem,
    limit: Duration,
) -> (Result<Planned, PlanError>, Option<Bound>) {
    let millis = limit.as_millis().max(1) as u64;
    let bar = indicatif::ProgressBar::hidden();
    bar.set_length(millis);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "planning [{bar:30}] {elapsed_precise} of the time limit, {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut shown = false;
    let BestPlan {
        result,
        skipped,
        failed,
        bound,
    } = plan_best_within(problem, limit, |p: &SearchProgress| {
        if !shown && p.elapsed >= Duration::from_secs(1) {
            bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
            bar.enable_steady_tick(Duration::from_millis(200));
            shown = true;
        }
        bar.set_position((p.elapsed.as_millis() as u64).min(millis));
        let best = p.best_overhead.map_or_else(
            || "no plan yet".to_string(),
            |o| format!("best {:.2}%", 100.0 * o),
        );
        bar.set_message(format!("{}; {best}", p.stage));
    });
    bar.finish_and_clear();
    for (name, why) in &skipped {
        println!("note: {name}: {why}");
    }
    for (name, error) in &failed {
        println!("warning: {name} failed and was left out: {error}");
    }
    (result, bound)
}

/// The lower bound, the gap, and whether the plan reorders the operations.
fn print_bound(planned: &Planned, bound: Option<&Bound>, took: Duration) {
    let overhead = planned.report.overhead();
    if let Some(b) = bound {
        println!(
            "lower bound   {:.2}% overhead for {} ({}): this plan is at most {:.2}% slower than the optimum",
            100.0 * b.overhead,
            b.holds_for,
            b.source,
            100.0 * b.gap(overhead)
        );
    }
    if planned.plan.reorders() {
        println!(
            "order         changed: the plan runs the operations in a memory-aware topological order, not the graph's (the simulator checked every input is computed before it is read)"
        );
    } else {
        println!("order         the graph's own");
    }
    println!("solve time    {:.3} s", took.as_secs_f64());
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
    let share = match ratio(r.peak_bytes, graph.store_all_peak()) {
        Some(x) => format!("{:.1}% of store-all", 100.0 * x),
        None => "store-all peak is 0 B".to_string(),
    };
    println!(
        "peak          {} ({share}), budget {}",
        human_bytes(r.peak_bytes),
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
fn compare(graph: &Graph, budgets: &[u64], bandwidth: f64, limit: Duration) -> anyhow::Result<()> {
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
        let rate = calibrate(&problem);
        let strategies = registry().into_iter().map(|s| {
            if s.name() == solve::NAME {
                Box::new(Anytime {
                    time_limit: Some(limit),
                })
            } else {
                s
            }
        });
        for strategy in strategies {
            let started = Instant::now();
            let skip = (strategy.name() != solve::NAME)
                .then(|| skipped_in_search(strategy.as_ref(), &problem, limit.as_secs_f64(), rate))
                .flatten();
            let result = match skip {
                Some(why) => Err(PlanError::NotApplicable {
                    strategy: strategy.name(),
                    why,
                }),
                None => strategy.plan(&problem),
            };
            let ms = started.elapsed().as_secs_f64() * 1e3;
            let budget_cell = format!(
                "{} ({})",
                human_bytes(budget),
                ratio_cell(budget, graph.store_all_peak(), 2)
            );
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

/// One row; a strategy without a plan gets "n/a \[k\]" and footnote k says why.
fn compare_row(
    graph: &Graph,
    budget: String,
    strategy: &dyn Strategy,
    result: Result<Planned, PlanError>,
    ms: f64,
    notes: &mut Vec<String>,
) -> Vec<String> {
    let store_all = graph.store_all_peak();
    let mut row = vec![budget, strategy.name()];
    match result {
        Ok(p) => {
            let r = &p.report;
            let (kept, swapped, recomputed) = r.bytes_by_fate(graph);
            row.extend([
                human_bytes(r.peak_bytes),
                ratio_cell(r.peak_bytes, store_all, 3),
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
                    "over budget: its smallest peak is {} ({} of store-all)",
                    human_bytes(best_peak),
                    ratio_cell(best_peak, store_all, 3)
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

/// `part / whole`, or `None` when `whole` is 0 (a graph whose tensors are all empty).
fn ratio(part: u64, whole: u64) -> Option<f64> {
    (whole > 0).then(|| part as f64 / whole as f64)
}

/// [`ratio`] as a table cell with `decimals` digits, `-` when undefined.
fn ratio_cell(part: u64, whole: u64, decimals: usize) -> String {
    ratio(part, whole).map_or_else(|| "-".to_string(), |x| format!("{x:.decimals$}"))
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

/// Checks output paths before any work: each names a file (not a path ending in `/`) in an
/// existing directory, and is either absent or a regular file, which the write replaces (a
/// rename would replace a device node or fail on a directory only after planning). Two
/// flags naming the same file are refused, since one would silently overwrite the other.
fn check_outputs(paths: &[&Path]) -> anyhow::Result<()> {
    let mut seen: Vec<(PathBuf, &Path)> = Vec::new();
    for &path in paths {
        let shown = path.display();
        let text = path.as_os_str().to_string_lossy();
        if text.ends_with('/') || text.ends_with(std::path::MAIN_SEPARATOR) {
            bail!("{shown}: ends with `/`, so it names a directory; give a file name");
        }
        let Some(name) = path.file_name() else {
            bail!("{shown}: does not name a file");
        };
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let dir = std::fs::canonicalize(parent)
            .with_context(|| format!("{shown}: directory {} does not exist", parent.display()))?;
        if !dir.is_dir() {
            bail!("{shown}: {} is not a directory", parent.display());
        }
        match std::fs::metadata(path) {
            Ok(meta) if meta.is_dir() => bail!("{shown}: is a directory; give a file name"),
            Ok(meta) if !meta.is_file() => bail!(
                "{shown}: exists and is not a regular file (a device, pipe or socket); refusing to replace it"
            ),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("{shown}: cannot inspect")),
        }
        let key = dir.join(name);
        if let Some((_, first)) = seen.iter().find(|(k, _)| *k == key) {
            bail!(
                "{shown} and {} are the same file: give --out and --plot different paths",
                first.display()
            );
        }
        seen.push((key, path));
    }
    Ok(())
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

/// Writes `bytes` to a new temporary file beside `path` and syncs it. The name is unique
/// (process id and a counter, created with `create_new`, retried on a clash), so two
/// outputs, or two runs, never share a temporary. Errors name `path`, the user's file.
fn write_temp(path: &Path, bytes: &[u8]) -> anyhow::Result<PathBuf> {
    use std::io::Write;
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let name = path
        .file_name()
        .with_context(|| format!("{}: not a file name", path.display()))?;
    let (tmp, mut file) = loop {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = path.with_file_name(format!(
            ".{}.{}.{n}.tmp",
            name.to_string_lossy(),
            std::process::id()
        ));
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
        {
            Ok(file) => break (tmp, file),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => {
                return Err(e).with_context(|| {
                    format!(
                        "{}: cannot create its temporary file {}",
                        path.display(),
                        tmp.display()
                    )
                });
            }
        }
    };
    if let Err(e) = file.write_all(bytes).and_then(|()| file.sync_all()) {
        drop(file);
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("{}: cannot write", path.display()));
    }
    Ok(tmp)
}

/// `0.7` (fraction of the store-all peak), `8GiB`, `500MB`, `1234`, `1e9` (bytes).
/// A plain number with a decimal point and no exponent is a fraction. Fractions are applied
/// exactly (decimal digits in integer arithmetic, rounded down), so `1.0` is exactly the
/// store-all peak whatever its size; a budget that comes to 0 bytes is an error.
pub fn parse_budget(text: &str, graph: &Graph) -> anyhow::Result<u64> {
    let t = text.trim();
    if t.is_empty() {
        bail!("--budget: an empty value (a stray comma?); give bytes (8GiB) or a fraction (0.7)");
    }
    if t.contains('.')
        && !t.contains(['e', 'E'])
        && t.chars().all(|c| c.is_ascii_digit() || c == '.')
    {
        let fraction = Decimal::parse(t).with_context(|| format!("--budget {t}"))?;
        // digits * 10^exp with exp <= 0 here (a decimal point and no exponent).
        let denominator = pow10(fraction.exp.unsigned_abs())
            .with_context(|| format!("--budget {t}: too many digits"))?;
        if fraction.digits == 0 || fraction.digits > denominator {
            bail!(
                "--budget {t}: a fraction must be in (0, 1]; give bytes with a unit (8GiB) or an integer"
            );
        }
        let peak = graph.store_all_peak();
        // peak < 2^64 and digits <= denominator <= 10^38 / ... : the product is checked.
        let bytes = u128::from(peak)
            .checked_mul(fraction.digits)
            .map(|p| p / denominator)
            .with_context(|| format!("--budget {t}: too many digits"))?;
        if bytes == 0 {
            bail!(
                "--budget {t}: {t} of the store-all peak ({}) is less than one byte",
                human_bytes(peak)
            );
        }
        return u64::try_from(bytes).with_context(|| format!("--budget {t}: out of range"));
    }
    let bytes = parse_bytes(t).with_context(|| format!("--budget {t}"))?;
    if bytes == 0 {
        bail!("--budget {t}: comes to 0 bytes; a budget must be at least 1 byte");
    }
    Ok(bytes)
}

/// `32GB/s`, `16GiB/s`, `1e9`: bytes per second.
pub fn parse_bandwidth(text: &str) -> anyhow::Result<f64> {
    let t = text.trim().trim_end_matches("/s");
    if t.trim().is_empty() {
        bail!("--bandwidth: an empty value; give bytes per second, e.g. 32GB/s");
    }
    let bytes = parse_bytes(t).with_context(|| format!("--bandwidth {text}"))?;
    if bytes == 0 {
        bail!(
            "--bandwidth {text}: comes to 0 bytes per second; the bandwidth is in bytes per second (32GB/s, 16GiB/s, 1e9) and must be at least 1 B/s"
        );
    }
    Ok(bytes as f64)
}

/// A non-negative decimal `digits * 10^exp`, read exactly.
#[derive(Debug, PartialEq)]
struct Decimal {
    digits: u128,
    exp: i32,
}

impl Decimal {
    /// `123`, `1.5`, `.5`, `1e9`, `2.5E-3`: digits, an optional point, an optional exponent.
    fn parse(text: &str) -> anyhow::Result<Decimal> {
        let not_a_number = || {
            anyhow::anyhow!(
                "`{text}` is not a number (expected digits with an optional decimal point and exponent, e.g. 0.7, 1234, 1e9)"
            )
        };
        if text.starts_with('-') {
            bail!("`{text}` is negative");
        }
        let (mantissa, exponent) = match text.find(['e', 'E']) {
            Some(i) => (&text[..i], Some(&text[i + 1..])),
            None => (text, None),
        };
        let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
        let all_digits = |s: &str| s.chars().all(|c| c.is_ascii_digit());
        if whole.is_empty() && fraction.is_empty() || !all_digits(whole) || !all_digits(fraction) {
            return Err(not_a_number());
        }
        let mut exp: i32 = match exponent {
            None => 0,
            Some(e) => {
                let digits = e.strip_prefix(['+', '-']).unwrap_or(e);
                if digits.is_empty() || !all_digits(digits) || digits.len() > 4 {
                    return Err(not_a_number());
                }
                e.parse().map_err(|_| not_a_number())?
            }
        };
        // Trailing zeros of the fraction carry no value; dropping them keeps `1.000...0`
        // exact however many zeros it has.
        let fraction = fraction.trim_end_matches('0');
        let mut digits: u128 = 0;
        for c in whole.chars().chain(fraction.chars()) {
            digits = digits
                .checked_mul(10)
                .and_then(|d| d.checked_add(u128::from(c as u8 - b'0')))
                .with_context(|| format!("`{text}` has too many digits"))?;
        }
        exp -= i32::try_from(fraction.len()).unwrap_or(i32::MAX);
        Ok(Decimal { digits, exp })
    }

    /// `self * scale`, rounded to the nearest integer (halves up); `None` above u64::MAX.
    fn times(&self, scale: u128) -> Option<u64> {
        let value = self.digits.checked_mul(scale)?;
        let rounded = if self.digits == 0 {
            0
        } else if self.exp >= 0 {
            value.checked_mul(pow10(self.exp.unsigned_abs())?)?
        } else {
            match pow10(self.exp.unsigned_abs()) {
                Some(d) => value / d + u128::from(value % d >= d.div_ceil(2)),
                // A divisor above 10^38 makes any representable value round to 0.
                None => 0,
            }
        };
        u64::try_from(rounded).ok()
    }
}

fn pow10(exp: u32) -> Option<u128> {
    10u128.checked_pow(exp)
}

/// A number (scientific notation allowed) followed by an optional unit: the unit is the
/// trailing run of letters, so the `e` of `1e9` stays in the number. Exact: the number is
/// read as a decimal and scaled in integers, then rounded to whole bytes.
fn parse_bytes(text: &str) -> anyhow::Result<u64> {
    const UNITS: &str = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB";
    let split = text
        .char_indices()
        .rev()
        .take_while(|(_, c)| c.is_ascii_alphabetic())
        .last()
        .map_or(text.len(), |(i, _)| i);
    let (number, unit) = text.split_at(split);
    let number = number.trim();
    if number.is_empty() {
        bail!(
            "`{text}` is not a size: expected a number with an optional unit ({UNITS}), e.g. 8GiB or 1e9"
        );
    }
    let scale: u128 = match unit.trim() {
        "" | "B" => 1,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        other => bail!("`{text}`: unknown unit `{other}` (use {UNITS})"),
    };
    let value = Decimal::parse(number)?;
    value
        .times(scale)
        .with_context(|| format!("`{text}` is more than 2^64 - 1 bytes"))
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

    fn err(r: anyhow::Result<impl std::fmt::Debug>) -> String {
        format!("{:#}", r.expect_err("an error"))
    }

    #[test]
    fn words_and_empty_values_are_named_as_not_numbers() {
        for bad in ["abc", "NaN", "inf", "x1"] {
            let text = err(parse_bytes(bad));
            assert!(
                text.contains(&format!("`{bad}` is not a")) && !text.contains("empty string"),
                "{bad}: {text}"
            );
        }
        assert!(err(parse_bandwidth("abc")).contains("`abc` is not a size"));
        assert!(err(parse_bandwidth("")).contains("empty value"));
        assert!(err(parse_bytes("-5")).contains("negative"));
        assert!(err(parse_bytes("3 parsecs")).contains("unknown unit `parsecs`"));
    }

    #[test]
    fn sizes_are_exact_up_to_u64_max() {
        assert_eq!(parse_bytes("18446744073709551615").unwrap(), u64::MAX);
        assert!(err(parse_bytes("18446744073709551616")).contains("2^64 - 1"));
        assert_eq!(parse_bytes("0.5KiB").unwrap(), 512);
        assert_eq!(parse_bytes("2.5").unwrap(), 3);
        assert_eq!(parse_bytes("1e-5").unwrap(), 0);
        assert_eq!(parse_bytes("1.25e2").unwrap(), 125);
    }

    #[test]
    fn bandwidth_below_one_byte_per_second_says_the_unit() {
        let text = err(parse_bandwidth("0.4"));
        assert!(
            text.contains("bytes per second") && text.contains("1 B/s"),
            "{text}"
        );
    }

    fn huge_graph(bytes: u64) -> Graph {
        let node = remat_planner::ir::Node {
            name: "a".into(),
            phase: remat_planner::ir::Phase::Forward,
            compute_time: 1.0,
            output_bytes: bytes,
            inputs: vec![],
        };
        Graph::new("g", vec![node], 0, 1.0).unwrap()
    }

    #[test]
    fn fraction_budgets_are_exact_on_huge_graphs() {
        // 2^63 + 2^62 + 5 has no exact f64: 1.0 must still be exactly store-all.
        let peak = (1u64 << 63) + (1u64 << 62) + 5;
        let g = huge_graph(peak);
        assert_eq!(parse_budget("1.0", &g).unwrap(), peak);
        assert_eq!(
            parse_budget("1.000000000000000000000000", &g).unwrap(),
            peak
        );
        assert_eq!(parse_budget("0.5", &g).unwrap(), peak / 2);
        assert!(err(parse_budget("1.5", &g)).contains("(0, 1]"));
    }

    #[test]
    fn budgets_that_round_to_zero_bytes_are_errors() {
        let g = huge_graph(1000);
        assert!(err(parse_budget("1e-5", &g)).contains("0 bytes"));
        assert!(err(parse_budget("0.00000000001", &g)).contains("less than one byte"));
        assert!(err(parse_budget("", &g)).contains("empty value"));
        assert!(err(parse_budget("0", &g)).contains("0 bytes"));
    }

    #[test]
    fn zero_store_all_peak_shows_a_dash_not_nan() {
        assert_eq!(ratio_cell(0, 0, 3), "-");
        assert_eq!(ratio_cell(1, 2, 2), "0.50");
    }

    #[test]
    fn plot_needs_a_known_extension_before_anything_runs() {
        assert_eq!(plot_format(Path::new("x.svg")).unwrap(), PlotFormat::Svg);
        assert!(plot_format(Path::new("x.jpg")).is_err());
    }
}
