//! The scale section of `remat bench plan`: how solve time, overhead and the solver's
//! memory grow with the graph, on random layered DAGs (Moccasin's generator, n = 250 to
//! 5,000) and transformer training graphs (8, 16, 32 layers and about 10,000 nodes), plus
//! Moccasin's published files when `--graphs` holds them (at the paper's byte budgets, with
//! the published figures beside).
//!
//! Moccasin's graphs are planned with swapping off (a bandwidth of 1 B/s, at which no swap
//! ever pays): the published figures are for recomputation alone, and at real bandwidths
//! swapping their kilobyte tensors is free, so every budget would cost nothing. The
//! transformer graphs use `--bandwidth`.
//!
//! Each solve runs in a child process (this binary with the hidden `--scale-worker`), so
//! that a solve can be stopped at `--scale-cap` seconds without leaving a thread running,
//! and so its memory is its own: the child resets its peak-RSS mark (`/proc/self/clear_refs`)
//! after building the graph and reports `VmHWM` minus `VmRSS` at that point.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use remat_planner::import::{ImportOptions, load};
use remat_planner::request::{self, RequestError};
use remat_planner::synth::{LayeredParams, TransformerParams, random_layered, transformer};
use remat_planner::{Graph, PlanError, Planned, Problem, lookup};
use remat_report::{Layout, print_table};

use crate::error::{Context, Result, bail};

/// The solvers compared at every size: the default search and two single strategies.
const SOLVERS: [&str; 3] = ["default", "evict", "mutwo"];
/// The marker of the worker's result line.
const RESULT: &str = "remat-scale-result";

/// A graph the worker can rebuild from a short text.
#[derive(Clone, Debug, PartialEq)]
pub enum GraphSpec {
    /// `layered:N:SEED`: a random layered DAG with Moccasin's parameters for N nodes.
    Layered { nodes: usize, seed: u64 },
    /// `transformer:LAYERS`: [`TransformerParams::gpt`].
    Transformer { layers: usize },
    /// `file:PATH`: a graph file.
    File(PathBuf),
}

impl GraphSpec {
    pub fn to_arg(&self) -> String {
        match self {
            GraphSpec::Layered { nodes, seed } => format!("layered:{nodes}:{seed}"),
            GraphSpec::Transformer { layers } => format!("transformer:{layers}"),
            GraphSpec::File(path) => format!("file:{}", path.display()),
        }
    }

    pub fn parse(text: &str) -> Result<GraphSpec> {
        let number = |s: &str| -> Result<u64> {
            s.parse()
                .with_context(|| format!("graph spec `{text}`: `{s}` is not a number"))
        };
        let parts: Vec<&str> = text.splitn(3, ':').collect();
        match parts.as_slice() {
            ["layered", n, seed] => Ok(GraphSpec::Layered {
                nodes: number(n)? as usize,
                seed: number(seed)?,
            }),
            ["transformer", layers] => Ok(GraphSpec::Transformer {
                layers: number(layers)? as usize,
            }),
            ["file", ..] => Ok(GraphSpec::File(PathBuf::from(&text["file:".len()..]))),
            _ => bail!(
                "graph spec `{text}`: expected layered:N:SEED, transformer:LAYERS or file:PATH"
            ),
        }
    }

    pub fn build(&self, options: ImportOptions) -> Result<Graph> {
        Ok(match self {
            GraphSpec::Layered { nodes, seed } => {
                random_layered(&LayeredParams::moccasin(*nodes), *seed)?
            }
            GraphSpec::Transformer { layers } => transformer(&TransformerParams::gpt(*layers))?,
            GraphSpec::File(path) => load(path, options)?,
        })
    }
}

/// One graph of the section and its budgets.
struct Case {
    spec: GraphSpec,
    label: String,
    budgets: Vec<(String, u64)>,
    /// Nodes of the published Moccasin file it is (for the published figures).
    published: Option<usize>,
    /// Recomputation only (swapping off), as the published figures are.
    recompute_only: bool,
}

/// A bandwidth at which swapping never pays: one byte per second.
const NO_SWAP_BANDWIDTH: &str = "1";

fn fraction_budgets(graph: &Graph, fractions: &[f64]) -> Vec<(String, u64)> {
    let peak = graph.store_all_peak();
    fractions
        .iter()
        .map(|f| (format!("{f:.1}"), (peak as f64 * f).ceil() as u64))
        .collect()
}

/// The synthetic graphs up to `max_nodes`, and the published layered files of `dir`.
fn cases(
    dir: Option<&std::path::Path>,
    max_nodes: usize,
    options: ImportOptions,
) -> Result<Vec<(Case, Graph)>> {
    let mut specs: Vec<(GraphSpec, Vec<f64>)> = Vec::new();
    for nodes in [250, 500, 1000, 5000] {
        specs.push((GraphSpec::Layered { nodes, seed: 1 }, vec![0.9, 0.8]));
    }
    // About 1,000, 2,000, 4,000 and 10,000 nodes.
    for layers in [8, 16, 32, 81] {
        specs.push((
            GraphSpec::Transformer { layers },
            vec![0.9, 0.8, 0.7, 0.5, 0.3],
        ));
    }
    for path in published_files(dir)? {
        specs.push((GraphSpec::File(path), vec![0.9, 0.8]));
    }
    let mut out = Vec::new();
    for (spec, fractions) in specs {
        let graph = spec.build(options)?;
        if graph.len() > max_nodes {
            continue;
        }
        let published = match &spec {
            GraphSpec::File(path) => path
                .file_name()
                .and_then(|n| LayeredParams::from_name(&n.to_string_lossy()).ok())
                .map(|p| p.nodes),
            _ => None,
        };
        let label = match &spec {
            GraphSpec::Layered { nodes, .. } => format!("layered n={nodes}"),
            GraphSpec::Transformer { layers } => format!("transformer {layers}L"),
            GraphSpec::File(_) => format!("published n={}", published.unwrap_or(graph.len())),
        };
        let case = Case {
            budgets: fraction_budgets(&graph, &fractions),
            recompute_only: !matches!(spec, GraphSpec::Transformer { .. }),
            spec,
            label,
            published,
        };
        out.push((case, graph));
    }
    Ok(out)
}

/// Moccasin's random layered files of 250 nodes or more in `dir` (their byte budgets are
/// the paper's: 0.9 and 0.8 of the stated order's peak, rounded up).
fn published_files(dir: Option<&std::path::Path>) -> Result<Vec<PathBuf>> {
    let Some(dir) = dir else {
        return Ok(Vec::new());
    };
    let mut files: Vec<(usize, PathBuf)> = std::fs::read_dir(dir)
        .with_context(|| format!("{}: cannot list", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|p| {
            let name = p.file_name()?.to_string_lossy().to_string();
            let params = LayeredParams::from_name(&name).ok()?;
            (params.nodes >= 250).then_some((params.nodes, p))
        })
        .collect();
    files.sort();
    Ok(files.into_iter().map(|(_, p)| p).collect())
}

/// Whether the main per-strategy table should leave this file to the scale section.
pub fn is_scale_file(path: &std::path::Path) -> bool {
    path.file_name()
        .and_then(|n| LayeredParams::from_name(&n.to_string_lossy()).ok())
        .is_some_and(|p| p.nodes >= 250)
}

/// The published results on Moccasin's files (issue 18's table: time overhead over the
/// given order; solve time), by node count and budget.
fn published_figures(nodes: usize, budget: &str) -> Option<&'static str> {
    Some(match (nodes, budget) {
        (250, "0.9") => "Checkmate 0.9% 685 s | Moccasin 0.9% 55 s | FastSA 0.0% 15 s",
        (250, "0.8") => "Checkmate none (time-out) | Moccasin 4.9% 640 s | FastSA 0.0% 15 s",
        (500, "0.9") => "Checkmate time-out | Moccasin 0.7% 1,803 s | FastSA 0.03% 21 s",
        (500, "0.8") => "Checkmate time-out | Moccasin 3.4% 1,803 s | FastSA 2.3% 21 s",
        (1000, "0.9") => "Checkmate time-out | Moccasin 0.7% 3,600 s | FastSA 0.4% 36 s",
        (1000, "0.8") => "Checkmate time-out | Moccasin 3.4% 3,600 s | FastSA 2.5% 36 s",
        _ => return None,
    })
}

/// What the worker measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Measured {
    pub overhead: f64,
    pub peak: u64,
    pub solve_s: f64,
    /// Growth of the resident set during the solve, bytes (`None`: not measurable here).
    pub rss_growth: Option<u64>,
    /// Bytes of the tensors the plan swaps.
    pub swapped_bytes: u64,
    pub strategy: String,
}

/// Runs one solve in this process and prints the result line (the `--scale-worker` side).
pub fn worker(arg: &str, bandwidth: f64, options: ImportOptions) -> Result<()> {
    let mut parts = arg.rsplitn(3, '|');
    let (Some(solver), Some(budget), Some(spec)) = (parts.next(), parts.next(), parts.next())
    else {
        bail!("--scale-worker `{arg}`: expected SPEC|BUDGET|SOLVER");
    };
    let budget: u64 = budget
        .parse()
        .with_context(|| format!("--scale-worker `{arg}`: budget `{budget}`"))?;
    let graph = GraphSpec::parse(spec)?.build(options)?;
    let problem = Problem {
        graph: &graph,
        budget_bytes: budget,
        bandwidth,
    };
    let base_rss = reset_peak_rss();
    let started = Instant::now();
    let result = solve(solver, &problem);
    let solve_s = started.elapsed().as_secs_f64();
    let growth = base_rss.and_then(|base| Some(peak_rss()?.saturating_sub(base)));
    match result {
        Ok(planned) => println!(
            "{RESULT} ok {} {} {solve_s} {} {} {}",
            planned.report.overhead(),
            planned.report.peak_bytes,
            growth.map_or("-".to_string(), |g| g.to_string()),
            planned.report.bytes_by_fate(&graph).1,
            planned.plan.strategy
        ),
        Err(
            RequestError::Infeasible { best_peak, .. }
            | RequestError::Plan(PlanError::OverBudget { best_peak, .. }),
        ) => {
            println!("{RESULT} over {best_peak}")
        }
        Err(e) => println!("{RESULT} err {}", e.to_string().replace('\n', " ")),
    }
    Ok(())
}

/// The default search through the planner's front door; a named solver alone, without
/// the bound a request climbs after it (the figure is the solver's time).
fn solve(solver: &str, problem: &Problem) -> std::result::Result<Planned, RequestError> {
    match solver {
        "default" => request::plan(problem, None, None, |_| {}).result,
        name => Ok(lookup(name)?.plan(problem)?),
    }
}

/// What a solve produced.
#[derive(Clone, Debug, PartialEq)]
pub enum Solved {
    Plan(Measured),
    /// No plan fits; the smallest peak reached, bytes.
    Over(u64),
    /// Another failure, the solver's message.
    Failed(String),
}

/// Parses the worker's result line.
pub fn parse_result(stdout: &str) -> Option<Solved> {
    let line = stdout.lines().find_map(|l| l.strip_prefix(RESULT))?.trim();
    if let Some(message) = line.strip_prefix("err ") {
        return Some(Solved::Failed(message.to_string()));
    }
    if let Some(peak) = line.strip_prefix("over ") {
        return peak.parse().ok().map(Solved::Over);
    }
    let fields: Vec<&str> = line.strip_prefix("ok ")?.splitn(6, ' ').collect();
    let [overhead, peak, secs, growth, swapped, strategy] = fields.as_slice() else {
        return None;
    };
    Some(Solved::Plan(Measured {
        overhead: overhead.parse().ok()?,
        peak: peak.parse().ok()?,
        solve_s: secs.parse().ok()?,
        rss_growth: growth.parse().ok(),
        swapped_bytes: swapped.parse().ok()?,
        strategy: strategy.to_string(),
    }))
}

/// Resets the kernel's peak-RSS mark to the current RSS (Linux 4.0+), returning the
/// current RSS; `None` where /proc does not allow it.
fn reset_peak_rss() -> Option<u64> {
    std::fs::write("/proc/self/clear_refs", "5").ok()?;
    status_kib("VmRSS:")
}

fn peak_rss() -> Option<u64> {
    status_kib("VmHWM:")
}

/// A `kB` field of /proc/self/status, in bytes.
fn status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line[field.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// The outcome of one solve as the parent saw it.
enum Run {
    Done(Solved),
    /// Still running at the cap (stopped).
    Capped,
}

/// Runs one solve in a child process, stopped after `cap`.
fn run_child(worker_args: &[String], cap: Duration) -> Result<Run> {
    let exe = std::env::current_exe().context("cannot find this binary to run a solve")?;
    let mut child = Command::new(exe)
        .args(worker_args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("cannot start a solve worker")?;
    let started = Instant::now();
    loop {
        if child.try_wait()?.is_some() {
            break;
        }
        if started.elapsed() > cap {
            // This is our own child, stopped by its id.
            let _ = child.kill();
            let _ = child.wait();
            return Ok(Run::Capped);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut stdout = String::new();
    if let Some(mut out) = child.stdout.take() {
        out.read_to_string(&mut stdout)?;
    }
    match parse_result(&stdout) {
        Some(result) => Ok(Run::Done(result)),
        None => bail!("a solve worker exited without a result: {stdout}"),
    }
}

/// The section's settings.
pub struct ScaleOptions<'a> {
    pub graphs: Option<&'a std::path::Path>,
    pub bandwidth: &'a str,
    pub time_unit: f64,
    pub cap_s: f64,
    pub max_nodes: usize,
    pub import: ImportOptions,
}

/// Runs the section and prints its table.
pub fn run(options: &ScaleOptions) -> Result<()> {
    let cases = cases(options.graphs, options.max_nodes, options.import)?;
    let total: usize = cases
        .iter()
        .map(|(c, _)| c.budgets.len() * SOLVERS.len())
        .sum();
    let bar = ProgressBar::new(total as u64);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut rows = Vec::new();
    for (case, graph) in &cases {
        for (fraction, budget) in &case.budgets {
            for solver in SOLVERS {
                bar.set_message(format!("{} at {fraction} ({solver})", case.label));
                let args = vec![
                    "bench".to_string(),
                    "plan".to_string(),
                    "--bandwidth".to_string(),
                    if case.recompute_only {
                        NO_SWAP_BANDWIDTH.to_string()
                    } else {
                        options.bandwidth.to_string()
                    },
                    "--time-unit".to_string(),
                    options.time_unit.to_string(),
                    "--scale-worker".to_string(),
                    format!("{}|{budget}|{solver}", case.spec.to_arg()),
                ];
                let run = run_child(&args, Duration::from_secs_f64(options.cap_s))?;
                rows.push(row(
                    case,
                    graph,
                    fraction,
                    *budget,
                    solver,
                    run,
                    options.cap_s,
                ));
                bar.inc(1);
            }
        }
    }
    bar.finish_and_clear();
    println!(
        "\nat scale: solve time, overhead, plan peak / budget and the solver's memory (RSS growth) against graph size; budgets are fractions of the store-all peak (published files: the paper's bytes); swap off: recomputation only (the published figures' setting); swap on: {}; each solve stopped at {} s",
        options.bandwidth, options.cap_s
    );
    print_table(
        Layout::Markdown,
        &[
            "graph",
            "nodes",
            "budget",
            "swap",
            "solver",
            "overhead",
            "solve s",
            "peak / budget",
            "RSS growth",
            "published (overhead, solve time)",
        ],
        &rows,
    );
    Ok(())
}

fn row(
    case: &Case,
    graph: &Graph,
    fraction: &str,
    budget: u64,
    solver: &str,
    run: Run,
    cap_s: f64,
) -> Vec<String> {
    let published = case
        .published
        .and_then(|n| published_figures(n, fraction))
        .filter(|_| solver == "default")
        .unwrap_or("-");
    let budget_cell = match case.published {
        Some(_) => format!("{fraction} ({budget} B)"),
        None => fraction.to_string(),
    };
    let mut cells = vec![
        case.label.clone(),
        graph.len().to_string(),
        budget_cell,
        if case.recompute_only { "off" } else { "on" }.to_string(),
        solver.to_string(),
    ];
    match run {
        Run::Done(Solved::Plan(m)) => cells.extend([
            // At 1 B/s a plan that swaps is no recompute-only plan: only swapping fit.
            if case.recompute_only && m.swapped_bytes > 0 {
                format!("swaps {} B", m.swapped_bytes)
            } else {
                format!("{:.2}%", 100.0 * m.overhead)
            },
            format!("{:.3}", m.solve_s),
            format!("{:.3}", m.peak as f64 / budget as f64),
            m.rss_growth
                .map_or("-".into(), |g| format!("{:.1} MB", g as f64 / 1e6)),
        ]),
        // The smallest peak any plan reached, over the budget.
        Run::Done(Solved::Over(peak)) => cells.extend([
            "infeasible".to_string(),
            "-".into(),
            format!("{:.3}", peak as f64 / budget as f64),
            "-".into(),
        ]),
        Run::Done(Solved::Failed(message)) => cells.extend([
            format!("no plan: {message}"),
            "-".into(),
            "-".into(),
            "-".into(),
        ]),
        Run::Capped => cells.extend([
            "stopped".to_string(),
            format!("> {cap_s}"),
            "-".into(),
            "-".into(),
        ]),
    }
    cells.push(published.to_string());
    cells
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_round_trip_and_bad_ones_are_named() {
        for spec in [
            GraphSpec::Layered {
                nodes: 250,
                seed: 3,
            },
            GraphSpec::Transformer { layers: 8 },
            GraphSpec::File(PathBuf::from("/tmp/a:b.json")),
        ] {
            assert_eq!(GraphSpec::parse(&spec.to_arg()).unwrap(), spec);
        }
        let err = GraphSpec::parse("layered:x:1").unwrap_err().to_string();
        assert!(err.contains("`x`"), "{err}");
        let err = GraphSpec::parse("ring:3").unwrap_err().to_string();
        assert!(err.contains("transformer:LAYERS"), "{err}");
    }

    #[test]
    fn result_lines_parse() {
        let Some(Solved::Plan(ok)) = parse_result(
            "noise\nremat-scale-result ok 0.025 1200 0.5 1048576 0 evict (local search)\n",
        ) else {
            panic!("not parsed")
        };
        assert_eq!(ok.peak, 1200);
        assert_eq!(ok.rss_growth, Some(1_048_576));
        assert_eq!(ok.strategy, "evict (local search)");
        let err = parse_result("remat-scale-result err cycle").unwrap();
        assert_eq!(err, Solved::Failed("cycle".to_string()));
        let over = parse_result("remat-scale-result over 1234").unwrap();
        assert_eq!(over, Solved::Over(1234));
        assert!(parse_result("nothing").is_none());
        let Some(Solved::Plan(no_rss)) = parse_result("remat-scale-result ok 0 1 0.1 - 64 mutwo")
        else {
            panic!("not parsed")
        };
        assert_eq!((no_rss.rss_growth, no_rss.swapped_bytes), (None, 64));
    }

    #[test]
    fn published_files_are_recognized_by_name() {
        assert!(is_scale_file(std::path::Path::new(
            "d/random_layered_n250_w0.43_nlv0.75_ed0.2_scd0.14.json"
        )));
        assert!(!is_scale_file(std::path::Path::new(
            "d/random_layered_n100_w0.27_nlv0.75_ed0.2_scd0.14.json"
        )));
        assert!(!is_scale_file(std::path::Path::new(
            "d/vgg16-b256-train.json"
        )));
        assert!(
            published_figures(1000, "0.8")
                .unwrap()
                .contains("FastSA 2.5%")
        );
        assert!(published_figures(1000, "0.7").is_none());
    }

    #[test]
    fn the_worker_measures_a_small_solve() {
        // The in-process half: peak RSS can be read (on Linux), and a budget under the
        // floor is an error line, not a crash.
        let graph = GraphSpec::Layered { nodes: 60, seed: 1 }
            .build(ImportOptions::default())
            .unwrap();
        let problem = Problem {
            graph: &graph,
            budget_bytes: graph.store_all_peak() * 9 / 10,
            bandwidth: 16e9,
        };
        let planned = solve("evict", &problem).unwrap();
        assert!(planned.report.peak_bytes <= problem.budget_bytes);
        let below = Problem {
            budget_bytes: graph.memory_floor() - 1,
            ..problem
        };
        assert!(solve("default", &below).is_err());
    }
}
