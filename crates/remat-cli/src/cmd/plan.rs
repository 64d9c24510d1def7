//! `remat plan GRAPH --budget ...`: plan keep/swap/recompute for a graph under a budget.
//!
//! One strategy (`--strategy`), or by default the anytime search (every strategy that can
//! finish in the time limit, then the `anytime` solver improving on the best until
//! `--time-limit`), prints the plan's peak, time overhead, a lower bound on the overhead of
//! any schedule and the gap to it, whether the operations were reordered, and bytes kept,
//! swapped and recomputed, and writes it with `--out`; `--compare` prints one table of every strategy at each budget; `--plot`
//! draws the plan's memory timeline against store-all's and the budget line.

mod multi;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use remat_planner::floor::recompute_floor;
use remat_planner::import::{ImportOptions, load};
use remat_planner::output::{check_outputs, write_all_atomic};
use remat_planner::request::{self, ImageFormat, Outcome, ratio};
use remat_planner::search::{SearchProgress, calibrate, skipped_in_search};
use remat_planner::solve::bound::Bound;
use remat_planner::solve::{self, Anytime, default_time_limit};
use remat_planner::strategy::baselines::PARAMETERIZED;
use remat_planner::{Graph, PlanError, PlanOrder, Planned, Problem, Strategy, eager, registry};
use remat_report::{Layout, print_table};
use remat_units::human_bytes;

use crate::units::{parse_bandwidth, parse_budget};
use crate::usage;

#[derive(clap::Args)]
pub struct Args {
    /// Graph file: remat's JSON schema or networkx node-link JSON (Checkmate graphs).
    /// Several graphs are planned together, as models trained in one step under one budget
    /// (MuTWO's multi-model setting): the plan, which model's compute hides which swap, and
    /// the comparison with each model alone at the same budget.
    #[arg(required_unless_present = "list", num_args = 1..)]
    pub graphs: Vec<PathBuf>,
    /// The plan form. One graph: `free` (any topological order; the default for a graph
    /// that does not fix its order), `node` (first computations in node order), `eager`
    /// (what PyTorch's eager autograd runs as it is: node order, values held while their
    /// forward readers are ahead, recomputation only right before a backward reader,
    /// offload right after the producer; refused under the eager floor). Several graphs:
    /// how their steps are merged (`interleaved`, the default: model i's backward beside
    /// model i+1's forward, as MuTWO multiplexes; `one-after-another`,
    /// `forwards-then-backwards`, `as-given`).
    #[arg(long)]
    pub order: Option<String>,
    /// Device budget: bytes (`8GiB`, `500MB`, `1234`) or a fraction of the store-all peak
    /// (`0.7`). Several, comma-separated, with --compare.
    #[arg(
        long,
        value_delimiter = ',',
        required_unless_present = "list",
        allow_hyphen_values = true
    )]
    pub budget: Vec<String>,
    /// List the strategies and exit.
    #[arg(long)]
    pub list: bool,
    /// Strategy name (see --list); default: the anytime search, the fastest plan found
    /// within --time-limit.
    #[arg(long)]
    pub strategy: Option<String>,
    /// Seconds the search may take (default: 1 s up to 1,000 nodes, 1 ms per node above).
    /// Also the limit of `--strategy anytime` and of every named strategy that can stop
    /// early (`evict`, `threshold`, `checkmate-milp`, ...: without it they run to the end),
    /// and each strategy's limit with --compare. Above 0, at most 1e6.
    #[arg(long, value_parser = crate::units::seconds_arg, allow_hyphen_values = true)]
    pub time_limit: Option<f64>,
    /// Host-device bandwidth, each direction (`32GB/s`, `16GiB/s`, bytes per second).
    #[arg(long, default_value = "32GB/s", allow_hyphen_values = true)]
    pub bandwidth: String,
    /// Seconds per unit of the graph's compute costs, for unitless networkx graphs.
    #[arg(long, default_value = "1e-6", value_parser = crate::units::seconds_arg, allow_hyphen_values = true)]
    pub time_unit: f64,
    /// Plan without swaps (recomputation only; --bandwidth is not used): a budget under
    /// the graph's recompute floor is refused, naming it, and a budget where only plans
    /// that swap were found is an error.
    #[arg(long)]
    pub recompute_only: bool,
    /// Write the plan as JSON.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Compare every strategy at the budget(s) in one table. Its columns: the budget (and
    /// its share of the store-all peak), the strategy, the simulated peak (bytes held at
    /// once, and its share of store-all), the time overhead against store-all with its
    /// recompute and exposed-swap parts, the bytes kept, swapped and recomputed (each
    /// operation's output by its fate, summed over the step: not held at once), and the
    /// strategy's solve time. A strategy without a plan shows `n/a [k]`; footnote k says
    /// why.
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
        print_table(
            Layout::Markdown,
            &["strategy", "kind", "what it does"],
            &rows,
        );
        println!("parameterized: {PARAMETERIZED}");
        return Ok(());
    }
    let options = ImportOptions {
        time_unit_s: args.time_unit,
    };
    let time_limit = args.time_limit.map(Duration::from_secs_f64);
    // What can be read without the graph is read before it is loaded: a bad value is
    // told before a missing file (a fraction's bytes, and a budget in bytes too small for
    // the graph, are known once it is loaded).
    for text in &args.budget {
        remat_units::parse_budget(text, "--budget")?;
    }
    parse_bandwidth(&args.bandwidth)?;
    let graph_path = match &args.graphs[..] {
        [] => return Err(usage!("give a GRAPH file")),
        [one] => one,
        several => return run_multi(&args, several, options, time_limit),
    };
    let order = args.order.as_deref().map(parse_plan_order).transpose()?;
    if let Some(name) = &args.strategy {
        registry::lookup(name).map_err(|e| usage!("--strategy {name}: {e}"))?;
    }
    let graph = load(graph_path, options)?;
    let graph = match order {
        None => graph,
        Some(order) => request::with_order(graph, order)?,
    };
    let bandwidth = parse_bandwidth(&args.bandwidth)?;
    let budgets = args
        .budget
        .iter()
        .map(|b| parse_budget(b, &graph))
        .collect::<anyhow::Result<Vec<u64>>>()?;
    check_flags(&args, budgets.len())?;
    let plot_format = args.plot.as_deref().map(plot_format).transpose()?;
    // Output paths are checked before planning, which can take minutes: a typo in a
    // directory, a device or a directory as target, or one path given twice is told now.
    let targets: Vec<(&str, &Path)> = [("--out", &args.out), ("--plot", &args.plot)]
        .into_iter()
        .filter_map(|(flag, path)| path.as_deref().map(|p| (flag, p)))
        .collect();
    check_outputs(&targets)?;
    let time_limit = time_limit.unwrap_or_else(|| default_time_limit(graph.len()));
    let recompute_floor = recompute_floor(&graph);
    // The eager floor is the form's own: printed only for eager requests.
    let eager_floor = if graph.order_is_eager() {
        format!(", eager floor {}", human_bytes(eager::floor(&graph)))
    } else {
        String::new()
    };
    println!(
        "graph {}: {} nodes, store-all peak {}, floor {}, recompute floor {} ({}){eager_floor}",
        graph.name(),
        graph.len(),
        human_bytes(graph.store_all_peak()),
        human_bytes(graph.memory_floor()),
        human_bytes(recompute_floor.bytes),
        if recompute_floor.exact {
            "exact"
        } else {
            "lower bound"
        }
    );
    if args.compare {
        return compare(&graph, &budgets, bandwidth, time_limit);
    }
    let [budget] = budgets[..] else {
        unreachable!("check_flags allows one budget without --compare");
    };
    let problem = Problem {
        graph: &graph,
        budget_bytes: budget,
        bandwidth,
    };
    if !args.recompute_only && (graph.memory_floor()..recompute_floor.bytes).contains(&budget) {
        println!(
            "note: the budget is below the recompute floor {}: every plan here swaps",
            human_bytes(recompute_floor.bytes)
        );
    }
    let started = Instant::now();
    let (planned, bound) = plan_with_progress(
        &problem,
        args.strategy.as_deref(),
        time_limit,
        args.recompute_only,
    )?;
    print!("{}", request::summary(&graph, &planned));
    print!("{}", request::bound_lines(&planned, bound.as_ref()));
    println!("solve time    {:.3} s", started.elapsed().as_secs_f64());
    // Everything is produced in memory first, so a failure writes no file at all.
    let mut outputs = Vec::new();
    let mut said = Vec::new();
    if let Some(path) = &args.out {
        outputs.push((path.clone(), planned.plan.to_json()?.into_bytes()));
        said.push(("plan written", path));
    }
    if let (Some(path), Some(format)) = (&args.plot, plot_format) {
        let bytes = request::timeline_image(&problem, &planned, format)?;
        outputs.push((path.clone(), bytes));
        said.push(("timeline drawn", path));
    }
    write_all_atomic(&outputs)?;
    for (what, path) in said {
        println!("{what} to {}", path.display());
    }
    Ok(())
}

/// Refuses flags that do not go together, before anything is printed.
fn check_flags(args: &Args, budgets: usize) -> anyhow::Result<()> {
    if args.compare {
        let ignored: Vec<&str> = [
            ("--recompute-only", args.recompute_only),
            ("--strategy", args.strategy.is_some()),
            ("--out", args.out.is_some()),
            ("--plot", args.plot.is_some()),
        ]
        .iter()
        .filter_map(|&(flag, given)| given.then_some(flag))
        .collect();
        if !ignored.is_empty() {
            return Err(usage!(
                "--compare runs every strategy and writes nothing: it cannot take {}",
                ignored.join(", ")
            ));
        }
    } else if budgets != 1 {
        return Err(usage!(
            "give one --budget without --compare (got {budgets})"
        ));
    }
    Ok(())
}

/// Several graphs: refuses what only one graph takes, then plans them together.
fn run_multi(
    args: &Args,
    graphs: &[PathBuf],
    options: ImportOptions,
    time_limit: Option<Duration>,
) -> anyhow::Result<()> {
    let refused: Vec<&str> = [
        ("--compare", args.compare),
        ("--plot", args.plot.is_some()),
        ("--recompute-only", args.recompute_only),
    ]
    .iter()
    .filter_map(|&(flag, given)| given.then_some(flag))
    .collect();
    if !refused.is_empty() {
        return Err(usage!(
            "{} graphs are planned together: {} takes one graph",
            graphs.len(),
            refused.join(" and ")
        ));
    }
    multi::run(multi::MultiArgs {
        graphs,
        budget: &args.budget,
        strategy: args.strategy.as_deref(),
        order: args.order.as_deref().unwrap_or("interleaved"),
        bandwidth: &args.bandwidth,
        options,
        time_limit,
        out: args.out.as_deref(),
    })
}

/// The plan form `--order` names for one graph.
fn parse_plan_order(text: &str) -> anyhow::Result<PlanOrder> {
    PlanOrder::from_name(text).ok_or_else(|| {
        let known: Vec<&str> = PlanOrder::ALL.iter().map(|o| o.name()).collect();
        usage!("--order {text}: unknown order; known: {}", known.join(", "))
    })
}

fn plot_format(path: &Path) -> anyhow::Result<ImageFormat> {
    match ImageFormat::from_path(path) {
        Some(format) => Ok(format),
        None => Err(usage!(
            "--plot {}: needs a .svg or .png file name",
            path.display()
        )),
    }
}

/// The named strategy, or the anytime search with a progress bar once it has run for a
/// second, then a note for each strategy that was skipped (too slow for the time left, or
/// not applicable) or failed. `recompute_only`: [`request::plan_recompute_only`].
fn plan_with_progress(
    problem: &Problem,
    strategy: Option<&str>,
    limit: Duration,
    recompute_only: bool,
) -> anyhow::Result<(Planned, Option<Bound>)> {
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
    let progress = |p: &SearchProgress| {
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
    };
    // The least peak is already in the error's words when nothing fits.
    let Outcome {
        result,
        skipped,
        failed,
        bound,
        least_peak: _,
    } = if recompute_only {
        request::plan_recompute_only(problem, strategy, Some(limit), progress)
    } else {
        request::plan(problem, strategy, Some(limit), progress)
    };
    bar.finish_and_clear();
    for (name, why) in &skipped {
        println!("note: {name}: {why}");
    }
    for (name, error) in &failed {
        println!("warning: {name} failed and was left out: {error}");
    }
    Ok((result?, bound))
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
    print_table(Layout::Markdown, &header, &rows);
    println!(
        "kept, swapped, recomputed: each operation's output by its fate, summed over the step (not held at once; peak is what is held at once)"
    );
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

/// [`ratio`] as a table cell with `decimals` digits, `-` when undefined.
fn ratio_cell(part: u64, whole: u64, decimals: usize) -> String {
    ratio(part, whole).map_or_else(|| "-".to_string(), |x| format!("{x:.decimals$}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_store_all_peak_shows_a_dash_not_nan() {
        assert_eq!(ratio_cell(0, 0, 3), "-");
        assert_eq!(ratio_cell(1, 2, 2), "0.50");
    }

    #[test]
    fn plot_needs_a_known_extension_before_anything_runs() {
        assert_eq!(plot_format(Path::new("x.svg")).unwrap(), ImageFormat::Svg);
        assert!(plot_format(Path::new("x.jpg")).is_err());
    }
}
