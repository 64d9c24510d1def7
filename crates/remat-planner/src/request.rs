//! The planner's front door: one planning request as the front ends make it (`remat plan`,
//! the Python package, the engine's sessions through [`crate::multi`]). [`plan`] is the one
//! entry point: a strategy by name ([`crate::registry::lookup`]), or the search over every
//! strategy for the fastest plan that fits ([`crate::search`]); when nothing fits, the error
//! says the smallest peak reached, in bytes people read. Also the report `remat plan`
//! prints, and the memory-timeline chart of a plan against store-all that `--plot` draws.
//!
//! Both front ends call these, so a budget means the same plan, and an infeasible one the
//! same message, wherever it is asked for.

use std::time::{Duration, Instant};

use thiserror::Error;

use crate::error::PlanError;
use crate::ir::Graph;
use crate::plan::PlanOrder;
use crate::plot::{Chart, PlotError, Series};
use crate::problem::{Planned, Problem};
use crate::registry::{lookup, registry};
use crate::search::{BestPlan, SearchProgress, search};
use crate::solve::bound::{Bound, cover_bound};
use crate::solve::{self, Anytime, default_time_limit};
use crate::strategy::Strategy;
use remat_units::human_bytes;

/// Why a request gave no plan.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum RequestError {
    /// The search found nothing under the budget.
    #[error(
        "budget {} is infeasible for every strategy: the smallest peak reached is {} (by {strategy})",
        human_bytes(*budget),
        human_bytes(*best_peak)
    )]
    Infeasible {
        budget: u64,
        best_peak: u64,
        strategy: String,
    },
    /// The budget is under [`Graph::memory_floor`]: no schedule can fit, whatever the
    /// strategy, so none is tried.
    #[error(
        "budget {} is below the graph's memory floor {} (static bytes plus the largest operation's inputs and output): no plan fits",
        human_bytes(*budget),
        human_bytes(*floor)
    )]
    BelowFloor { budget: u64, floor: u64 },
    /// A recompute-only request under the recompute floor ([`crate::floor`]): no plan
    /// without swaps fits, whatever the strategy, so none is tried.
    #[error(
        "budget {} is below the graph's recompute floor {} ({}): no recompute-only plan fits",
        human_bytes(*budget),
        human_bytes(*floor),
        crate::floor::floor_kind(*exact)
    )]
    BelowRecomputeFloor {
        budget: u64,
        floor: u64,
        exact: bool,
    },
    /// An eager-order request under the eager floor ([`crate::eager::floor`]): no eager
    /// plan fits, whatever is recomputed or offloaded, so none is tried.
    #[error(
        "budget {} is below the graph's eager floor {} (every value eager autograd holds at some operation, with its inputs and output): no eager-order plan fits",
        human_bytes(*budget),
        human_bytes(*floor)
    )]
    BelowEagerFloor { budget: u64, floor: u64 },
    /// A plan order the graph cannot be planned in ([`with_order`]).
    #[error("graph `{graph}` cannot be planned in {} order: {why}", order.name())]
    Order {
        graph: String,
        order: PlanOrder,
        why: String,
    },
    /// A recompute-only request whose fastest plan found still swaps: no plan without swaps
    /// was found under the budget (the recompute floor is below it, so one may exist).
    #[error(
        "budget {} has no recompute-only plan found: the fastest plan ({strategy}) swaps {} (the recompute floor is {}{})",
        human_bytes(*budget),
        human_bytes(*swapped),
        human_bytes(*floor),
        least_peak_note(*least_peak)
    )]
    SwapsNeeded {
        budget: u64,
        floor: u64,
        swapped: u64,
        strategy: String,
        /// The least peak the recompute-only attempts reached, when one was measured.
        least_peak: Option<u64>,
    },
    /// Any other planner error, as the planner words it.
    #[error(transparent)]
    Plan(PlanError),
}

/// The clause of [`RequestError::SwapsNeeded`] naming the least recompute-only peak.
fn least_peak_note(least_peak: Option<u64>) -> String {
    least_peak.map_or_else(String::new, |peak| {
        format!(
            "; without swaps the least peak reached is {}",
            human_bytes(peak)
        )
    })
}

impl From<PlanError> for RequestError {
    fn from(error: PlanError) -> RequestError {
        match error {
            PlanError::Infeasible {
                budget,
                best_peak,
                strategy,
            } => RequestError::Infeasible {
                budget,
                best_peak,
                strategy,
            },
            PlanError::BelowFloor { budget, floor } => RequestError::BelowFloor { budget, floor },
            PlanError::BelowRecomputeFloor {
                budget,
                floor,
                exact,
            } => RequestError::BelowRecomputeFloor {
                budget,
                floor,
                exact,
            },
            PlanError::BelowEagerFloor { budget, floor } => {
                RequestError::BelowEagerFloor { budget, floor }
            }
            other => RequestError::Plan(other),
        }
    }
}

/// `graph` marked for planning in `order`, the request's plan form: `Free` keeps a graph
/// that does not fix its order as it is (a graph whose order is fixed, the engine's and
/// `remat.torch`'s steps, is refused: another order would change its results' bits),
/// `Node` fixes the node order ([`Graph::with_fixed_order`]), `Eager` asks for plans
/// PyTorch's eager autograd runs as they are ([`Graph::with_eager_order`], [`crate::eager`]).
/// Every strategy and the search then plan in that form, and the plans say so
/// ([`crate::plan::Plan::order`]).
pub fn with_order(graph: Graph, order: PlanOrder) -> Result<Graph, RequestError> {
    let refuse = |graph: &Graph, why: String| RequestError::Order {
        graph: graph.name().to_string(),
        order,
        why,
    };
    match order {
        PlanOrder::Free if graph.order_is_fixed() => Err(refuse(
            &graph,
            "it fixes its order (`fixed_order`): its operations have effects in node order".into(),
        )),
        PlanOrder::Free => Ok(graph),
        PlanOrder::Node if graph.order_is_eager() => Err(refuse(
            &graph,
            "it is marked for the eager order already".into(),
        )),
        PlanOrder::Node => Ok(graph.with_fixed_order()),
        PlanOrder::Eager => {
            let name = graph.name().to_string();
            graph.with_eager_order().map_err(|e| RequestError::Order {
                graph: name,
                order,
                why: e.to_string(),
            })
        }
    }
}

/// Refuses a budget below the graph's memory floor before any strategy runs
/// ([`crate::problem::check_floor`], in the words people read).
pub fn check_floor(problem: &Problem) -> Result<(), RequestError> {
    crate::problem::check_floor(problem).map_err(RequestError::from)
}

pub use crate::problem::RECOMPUTE_ONLY_BANDWIDTH;

/// What a request found, with the search's notes (empty for a named strategy).
#[derive(Debug)]
pub struct Outcome {
    pub result: Result<Planned, RequestError>,
    /// `(strategy, why)` for strategies the search skipped or that did not apply.
    pub skipped: Vec<(String, String)>,
    /// Strategies that failed with an error other than over budget / not applicable.
    pub failed: Vec<(String, PlanError)>,
    /// A lower bound on the overhead of every schedule at this budget (none when the
    /// budget is refused before planning).
    pub bound: Option<Bound>,
    /// The least peak of the plans that did not fit (none when every attempt fitted or
    /// none ran): what the errors name when nothing fits.
    pub least_peak: Option<u64>,
}

/// Plans `problem` with the strategy named `strategy` (parameterized names such as
/// `every:4` included; `anytime` runs for `time_limit`, and a strategy that can stop early
/// stops there when `time_limit` is given), or, without a name, with the anytime
/// search: every strategy that can finish in the time left, then the `anytime` solver
/// improving on the best until `time_limit` ([`default_time_limit`] when `None`).
/// `progress` is called as the search goes. A budget below the memory floor is refused
/// before anything runs.
pub fn plan(
    problem: &Problem,
    strategy: Option<&str>,
    time_limit: Option<Duration>,
    progress: impl FnMut(&SearchProgress),
) -> Outcome {
    let limit = time_limit.unwrap_or_else(|| default_time_limit(problem.graph.len()));
    if let Err(error) = check_floor(problem) {
        return Outcome {
            result: Err(error),
            skipped: Vec::new(),
            failed: Vec::new(),
            bound: None,
            least_peak: None,
        };
    }
    match strategy {
        Some(name) => plan_named(problem, name, limit, time_limit.is_some()),
        None => {
            let BestPlan {
                result,
                skipped,
                failed,
                bound,
                smallest_peak,
            } = search(&registry(), problem, limit, progress);
            Outcome {
                result: result.map_err(RequestError::from),
                skipped,
                failed,
                bound,
                least_peak: smallest_peak,
            }
        }
    }
}

/// [`plan`] with no swaps: refuses a budget under the recompute floor
/// ([`crate::problem::check_recompute_floor`]) before anything runs, plans at
/// [`RECOMPUTE_ONLY_BANDWIDTH`] (the plan records that bandwidth), and reports
/// [`RequestError::SwapsNeeded`] when the fastest plan found still swaps.
pub fn plan_recompute_only(
    problem: &Problem,
    strategy: Option<&str>,
    time_limit: Option<Duration>,
    progress: impl FnMut(&SearchProgress),
) -> Outcome {
    let refused = check_floor(problem)
        .and_then(|()| crate::problem::check_recompute_floor(problem).map_err(RequestError::from));
    if let Err(error) = refused {
        return Outcome {
            result: Err(error),
            skipped: Vec::new(),
            failed: Vec::new(),
            bound: None,
            least_peak: None,
        };
    }
    let recompute_only = Problem {
        bandwidth: RECOMPUTE_ONLY_BANDWIDTH,
        ..*problem
    };
    let mut outcome = plan(&recompute_only, strategy, time_limit, progress);
    if let Ok(planned) = &outcome.result {
        let swapped = planned.report.swapped_out_bytes;
        if swapped > 0 {
            outcome.result = Err(RequestError::SwapsNeeded {
                budget: problem.budget_bytes,
                floor: crate::floor::recompute_floor(problem.graph).bytes,
                swapped,
                strategy: planned.plan.strategy.clone(),
                least_peak: outcome.least_peak,
            });
        }
    }
    outcome
}

/// One strategy by name, then the covering bound for a tenth of the time the plan took
/// (at least 0.1 s), sized by the plan's overhead. `anytime` runs for `limit`; another
/// strategy stops there ([`Strategy::plan_until`]) only when the caller gave the limit
/// (`limited`): asked for by name without one, an exact strategy runs to its optimum.
fn plan_named(problem: &Problem, name: &str, limit: Duration, limited: bool) -> Outcome {
    let started = Instant::now();
    let strategy: Result<Box<dyn Strategy>, PlanError> = if name == solve::NAME {
        Ok(Box::new(Anytime {
            time_limit: Some(limit),
        }))
    } else {
        lookup(name)
    };
    let result = strategy.and_then(|s| {
        if limited {
            s.plan_until(problem, started + limit)
        } else {
            s.plan(problem)
        }
    });
    let bound = result.as_ref().ok().map(|planned| {
        let spent = started.elapsed().max(Duration::from_secs(1)) / 10;
        cover_bound(
            problem,
            Instant::now() + spent,
            Some(planned.report.overhead()),
        )
    });
    let least_peak = match &result {
        Err(PlanError::OverBudget { best_peak, .. }) => Some(*best_peak),
        _ => None,
    };
    Outcome {
        result: result.map_err(RequestError::from),
        skipped: Vec::new(),
        failed: Vec::new(),
        bound,
        least_peak,
    }
}

/// The plan's report as `remat plan` prints it: strategy, peak against store-all and the
/// budget, time overhead with its parts in seconds, and bytes kept, swapped and recomputed;
/// one line each, each ending in a newline.
pub fn summary(graph: &Graph, planned: &Planned) -> String {
    let r = &planned.report;
    let (kept, swapped, recomputed) = r.bytes_by_fate(graph);
    let share = match ratio(r.peak_bytes, graph.store_all_peak()) {
        Some(x) => format!("{:.1}% of store-all", 100.0 * x),
        None => "store-all peak is 0 B".to_string(),
    };
    let unit = graph.time_unit_s();
    format!(
        "strategy      {}\n\
         peak          {} ({share}), budget {}\n\
         time overhead {:.2}% (recompute {:.4} s, exposed swap {:.4} s, base {:.4} s)\n\
         bytes         kept {}, swapped {}, recomputed {} (each operation's output by its fate, summed over the step: not held at once; the peak is)\n",
        planned.plan.strategy,
        human_bytes(r.peak_bytes),
        human_bytes(planned.plan.budget_bytes),
        100.0 * r.overhead(),
        r.recompute_time * unit,
        r.stall_time * unit,
        r.base_time * unit,
        human_bytes(kept),
        human_bytes(swapped),
        human_bytes(recomputed)
    )
}

/// The lower bound and the gap to it, and whether the plan reorders the operations, as
/// `remat plan` prints them after [`summary`]; one line each, each ending in a newline.
pub fn bound_lines(planned: &Planned, bound: Option<&Bound>) -> String {
    let mut text = String::new();
    if let Some(b) = bound {
        text.push_str(&format!(
            "lower bound   {:.2}% overhead for {} ({}): this plan is at most {:.2}% slower than the optimum\n",
            100.0 * b.overhead,
            b.holds_for,
            b.source,
            100.0 * b.gap(planned.report.overhead())
        ));
    }
    text.push_str(if planned.plan.order == PlanOrder::Eager {
        "order         eager: the forward and backward in node order, held values kept while their readers are ahead, recomputation only right before a backward reader, offload right after the producer (checked step by step)\n"
    } else if planned.plan.reorders() {
        "order         changed: the plan runs the operations in a memory-aware topological order, not the graph's (the simulator checked every input is computed before it is read)\n"
    } else {
        "order         the graph's own\n"
    });
    text
}

/// `part / whole`, or `None` when `whole` is 0 (a graph whose tensors are all empty).
pub fn ratio(part: u64, whole: u64) -> Option<f64> {
    (whole > 0).then(|| part as f64 / whole as f64)
}

/// Why a timeline cannot be drawn.
#[derive(Debug, Error)]
pub enum ChartError {
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(transparent)]
    Plot(#[from] PlotError),
}

/// Image formats a timeline is drawn in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageFormat {
    Svg,
    Png,
}

impl ImageFormat {
    /// The format a file name asks for by its extension (`.svg`, `.png`).
    pub fn from_path(path: &std::path::Path) -> Option<ImageFormat> {
        match path.extension().and_then(|e| e.to_str()) {
            Some("svg") => Some(ImageFormat::Svg),
            Some("png") => Some(ImageFormat::Png),
            _ => None,
        }
    }
}

/// The plan's device memory over time against store-all's, with the budget as a line,
/// drawn in `format` (PNG at 1200x600).
pub fn timeline_image(
    problem: &Problem,
    planned: &Planned,
    format: ImageFormat,
) -> Result<Vec<u8>, ChartError> {
    let chart = timeline_chart(problem, planned)?;
    Ok(match format {
        ImageFormat::Svg => chart.to_svg().into_bytes(),
        ImageFormat::Png => chart.to_png(1200, 600)?,
    })
}

/// [`timeline_image`]'s chart: times in seconds, memory in bytes.
pub fn timeline_chart(problem: &Problem, planned: &Planned) -> Result<Chart, PlanError> {
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
    Ok(Chart {
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
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Node, Phase};

    /// a -> b (forward) -> c (backward, reads a and b): store-all keeps a and b.
    fn chain() -> Graph {
        let node = |name: &str, phase, inputs: Vec<usize>| Node {
            name: name.into(),
            phase,
            compute_time: 1.0,
            output_bytes: 100,
            inputs,
        };
        let nodes = vec![
            node("a", Phase::Forward, vec![]),
            node("b", Phase::Forward, vec![0]),
            node("c", Phase::Backward, vec![0, 1]),
        ];
        Graph::new("chain", nodes, 0, 1.0).unwrap()
    }

    fn problem(graph: &Graph, budget_bytes: u64) -> Problem<'_> {
        Problem {
            graph,
            budget_bytes,
            bandwidth: 1e9,
        }
    }

    /// a -> b -> c, d reads a and c: store-all holds a, b and c at c (300 bytes); the
    /// floor is 201 (d with a and c).
    fn skip() -> Graph {
        let node = |name: &str, bytes, inputs: Vec<usize>| Node {
            name: name.into(),
            phase: Phase::Forward,
            compute_time: 1.0,
            output_bytes: bytes,
            inputs,
        };
        let nodes = vec![
            node("a", 100, vec![]),
            node("b", 100, vec![0]),
            node("c", 100, vec![1]),
            node("d", 1, vec![0, 2]),
        ];
        Graph::new("skip", nodes, 0, 1.0).unwrap()
    }

    #[test]
    fn a_request_that_fits_nothing_says_the_least_peak_reached() {
        // 250 is above the floor, and store-all cannot fit it.
        let g = skip();
        assert_eq!((g.memory_floor(), g.store_all_peak()), (201, 300));
        let outcome = plan(&problem(&g, 250), Some("store-all"), None, |_| {});
        assert!(outcome.result.is_err());
        assert_eq!(outcome.least_peak, Some(300));
        let fits = plan(&problem(&g, 300), Some("store-all"), None, |_| {});
        assert!(fits.result.is_ok());
        assert_eq!(fits.least_peak, None);
    }

    #[test]
    fn a_named_strategy_stops_at_a_time_limit_given_and_only_then() {
        // At 250 bytes evict drops a and rebuilds it for d.
        let g = skip();
        let unlimited = plan(&problem(&g, 250), Some("evict"), None, |_| {});
        assert!(unlimited.result.is_ok());
        let none_left = plan(
            &problem(&g, 250),
            Some("evict"),
            Some(Duration::ZERO),
            |_| {},
        );
        match none_left.result {
            Err(RequestError::Plan(PlanError::NotApplicable { why, .. })) => {
                assert!(why.contains("out of time"), "{why}")
            }
            other => panic!("expected out of time, got {other:?}"),
        }
    }

    #[test]
    fn swaps_needed_names_the_least_peak_without_swaps_when_known() {
        let error = |least_peak| RequestError::SwapsNeeded {
            budget: 1 << 20,
            floor: 1 << 19,
            swapped: 1 << 18,
            strategy: "mutwo".into(),
            least_peak,
        };
        let with = error(Some(3 << 19)).to_string();
        assert!(
            with.ends_with("(the recompute floor is 512.00 KiB; without swaps the least peak reached is 1.50 MiB)"),
            "{with}"
        );
        let without = error(None).to_string();
        assert!(
            without.ends_with("(the recompute floor is 512.00 KiB)"),
            "{without}"
        );
    }

    #[test]
    fn a_named_strategy_is_planned_and_an_unknown_one_is_named() {
        let g = chain();
        let outcome = plan(&problem(&g, 1000), Some("store-all"), None, |_| {});
        let planned = outcome.result.expect("store-all fits 1000 bytes");
        assert_eq!(planned.plan.strategy, "store-all");
        assert_eq!(planned.report.peak_bytes, g.store_all_peak());
        let err = plan(&problem(&g, 1000), Some("nope"), None, |_| {})
            .result
            .expect_err("unknown");
        assert!(err.to_string().contains("unknown strategy `nope`"), "{err}");
    }

    #[test]
    fn the_search_reports_progress_and_explains_an_infeasible_budget() {
        let g = chain();
        let mut calls = 0;
        let outcome = plan(&problem(&g, 1000), None, None, |_| calls += 1);
        assert!(outcome.result.is_ok());
        let bound = outcome.bound.expect("the search bounds the overhead");
        assert_eq!(bound.overhead, 0.0, "store-all fits: nothing to pay");
        assert!(calls >= 1, "the search reports where it stands");
        // Below the floor (c with both inputs: 300 bytes) nothing fits, and nothing runs.
        let refused = plan(&problem(&g, 250), None, None, |_| {});
        assert!(refused.bound.is_none());
        match refused.result.expect_err("below the floor") {
            RequestError::BelowFloor { budget, floor } => assert_eq!((budget, floor), (250, 300)),
            other => panic!("expected BelowFloor, got {other}"),
        }
        // The search's "nothing fits" reads in bytes people read.
        let err = RequestError::from(PlanError::Infeasible {
            budget: 250,
            best_peak: 300,
            strategy: "evict".into(),
        });
        assert_eq!(
            err.to_string(),
            "budget 250 B is infeasible for every strategy: the smallest peak reached is 300 B (by evict)"
        );
        let below = check_floor(&problem(&g, 299)).expect_err("below the floor");
        assert_eq!(
            below,
            RequestError::BelowFloor {
                budget: 299,
                floor: 300
            }
        );
        assert!(below.to_string().contains("memory floor 300 B"), "{below}");
        check_floor(&problem(&g, 300)).expect("at the floor");
    }

    #[test]
    fn the_summary_has_the_four_lines_of_remat_plan() {
        let g = chain();
        let planned = plan(&problem(&g, 1000), Some("store-all"), None, |_| {})
            .result
            .unwrap();
        let text = summary(&g, &planned);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "strategy      store-all");
        assert_eq!(
            lines[1],
            "peak          300 B (100.0% of store-all), budget 1000 B"
        );
        assert!(
            lines[2].starts_with("time overhead 0.00% (recompute 0.0000 s"),
            "{text}"
        );
        assert_eq!(
            lines[3],
            "bytes         kept 300 B, swapped 0 B, recomputed 0 B (each operation's output by its fate, summed over the step: not held at once; the peak is)"
        );
        assert_eq!(ratio(1, 0), None);
    }

    #[test]
    fn the_timeline_is_drawn_in_the_asked_format() {
        let g = chain();
        let p = problem(&g, 1000);
        let planned = plan(&p, Some("store-all"), None, |_| {}).result.unwrap();
        let svg = timeline_image(&p, &planned, ImageFormat::Svg).unwrap();
        assert!(String::from_utf8_lossy(&svg).contains("<svg"));
        let png = timeline_image(&p, &planned, ImageFormat::Png).unwrap();
        assert_eq!(&png[1..4], b"PNG");
        let path = std::path::Path::new;
        assert_eq!(
            ImageFormat::from_path(path("x.png")),
            Some(ImageFormat::Png)
        );
        assert_eq!(ImageFormat::from_path(path("x.jpg")), None);
    }
}
