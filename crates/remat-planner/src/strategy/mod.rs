//! Strategies and their registry.
//!
//! A [`Strategy`] turns a [`Problem`] (graph, budget, bandwidth) into a [`Plan`]. Strategies
//! that think per tensor (the baselines, MuTWO) build [`Decision`]s and call
//! [`plan_from_decisions`], which lowers them with [`crate::lower::lower`] and checks the
//! result with the simulator; schedule-native strategies (the exact ones) build steps and call
//! [`plan_from_steps`]. Both return [`PlanError::OverBudget`] with the plan's peak when it
//! does not fit, so callers can report the smallest peak reached.
//!
//! [`registry`] lists every strategy; [`lookup`] finds one by name, including the
//! parameterized `every:N`, `by-depth:D` and `threshold:F`.

pub mod baselines;
pub mod mutwo;

use crate::error::PlanError;
use crate::ir::Graph;
use crate::lower::{Helpers, lower_with};
use crate::plan::{Decision, PLAN_FORMAT_VERSION, Plan, Step};
use crate::sim::{SimReport, simulate_steps};

/// Node count above which searches skip strategies whose single plan is quadratic in size.
pub const QUADRATIC_PLAN_LIMIT: usize = 5000;
/// Node count above which searches skip strategies that simulate many quadratic
/// candidates: about a few seconds each at this size on one core.
pub const CANDIDATE_SEARCH_LIMIT: usize = 2500;

/// What to plan for.
#[derive(Clone, Copy, Debug)]
pub struct Problem<'g> {
    pub graph: &'g Graph,
    /// Device bytes available, static memory included.
    pub budget_bytes: u64,
    /// Host-device bandwidth in bytes per second, each direction.
    pub bandwidth: f64,
}

/// A plan together with the simulator's measurements of it.
#[derive(Clone, Debug)]
pub struct Planned {
    pub plan: Plan,
    pub report: SimReport,
}

/// A way to decide what to keep, swap and recompute.
pub trait Strategy: Send + Sync {
    /// Registry name, used by `--strategy`.
    fn name(&self) -> String;
    /// One line for `--help` and tables.
    fn summary(&self) -> &'static str;
    /// Whether the strategy can give optimal plans for its model (listed as exact).
    fn is_exact(&self) -> bool {
        false
    }
    /// Whether its plan for this problem is optimal for its model: the benchmark's
    /// reference. A strategy exact only under conditions (`chain-dp` needs lossless memory
    /// units) says so here.
    fn is_exact_for(&self, _problem: &Problem) -> bool {
        self.is_exact()
    }
    /// Plans under the budget, or says why not ([`PlanError::OverBudget`] carries the peak
    /// the strategy could reach).
    fn plan(&self, problem: &Problem) -> Result<Planned, PlanError>;
    /// For strategies whose running time grows faster than linearly in the node count
    /// (quadratic plans, or many simulated candidates): the node count above which a
    /// search over all strategies ([`plan_best`], `--compare`) skips them, and why.
    /// Asked for by name, they still run.
    fn search_limit(&self) -> Option<(usize, &'static str)> {
        None
    }
}

/// Why a search skips `strategy` on `problem`'s graph, if it does (see
/// [`Strategy::search_limit`]).
pub fn skipped_in_search(strategy: &dyn Strategy, problem: &Problem) -> Option<String> {
    let (limit, why) = strategy.search_limit()?;
    let n = problem.graph.len();
    (n > limit).then(|| {
        format!(
            "skipped: the graph has {n} nodes, above the {limit} at which it is searched ({why}); ask for it with --strategy {}",
            strategy.name()
        )
    })
}

/// Lowers per-tensor decisions, simulates them and checks the budget.
pub fn plan_from_decisions(
    problem: &Problem,
    strategy: &str,
    decisions: Vec<Decision>,
) -> Result<Planned, PlanError> {
    plan_from_decisions_with(problem, strategy, decisions, Helpers::Free)
}

/// [`plan_from_decisions`] with a choice of what happens to recompute helpers.
pub fn plan_from_decisions_with(
    problem: &Problem,
    strategy: &str,
    decisions: Vec<Decision>,
    helpers: Helpers,
) -> Result<Planned, PlanError> {
    let lowered =
        lower_with(problem.graph, &decisions, problem.bandwidth, helpers).map_err(|e| match e {
            PlanError::InvalidSchedule { error, .. } => PlanError::InvalidSchedule {
                strategy: strategy.to_string(),
                error,
            },
            other => other,
        })?;
    plan_from_steps(problem, strategy, lowered.steps, lowered.decisions)
}

/// Simulates a schedule and checks the budget.
pub fn plan_from_steps(
    problem: &Problem,
    strategy: &str,
    steps: Vec<Step>,
    decisions: Vec<Decision>,
) -> Result<Planned, PlanError> {
    let report = simulate_steps(problem.graph, &steps, problem.bandwidth).map_err(|error| {
        PlanError::InvalidSchedule {
            strategy: strategy.to_string(),
            error,
        }
    })?;
    if report.peak_bytes > problem.budget_bytes {
        return Err(PlanError::OverBudget {
            strategy: strategy.to_string(),
            budget: problem.budget_bytes,
            best_peak: report.peak_bytes,
        });
    }
    let plan = Plan {
        version: PLAN_FORMAT_VERSION,
        graph: problem.graph.name().to_string(),
        node_count: problem.graph.len(),
        strategy: strategy.to_string(),
        budget_bytes: problem.budget_bytes,
        bandwidth_bytes_per_s: problem.bandwidth,
        steps,
        decisions,
    };
    Ok(Planned { plan, report })
}

/// Every registered strategy, fast ones first.
pub fn registry() -> Vec<Box<dyn Strategy>> {
    let mut strategies = baselines::all();
    strategies.push(Box::new(mutwo::MuTwo));
    strategies.push(Box::new(mutwo::MuTwoRefined));
    // Exact and large-graph strategies (crate::exact) extend this list.
    strategies.extend(crate::exact::strategies());
    strategies
}

/// Finds a strategy by name; `every:N`, `by-depth:D` and `threshold:F` take a parameter.
pub fn lookup(name: &str) -> Result<Box<dyn Strategy>, PlanError> {
    if let Some(parsed) = baselines::parse(name) {
        return parsed;
    }
    registry()
        .into_iter()
        .find(|s| s.name() == name)
        .ok_or_else(|| PlanError::UnknownStrategy {
            name: name.to_string(),
            known: registry()
                .iter()
                .map(|s| s.name())
                .chain(std::iter::once(baselines::PARAMETERIZED.to_string()))
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// What [`plan_best_explained`] found: the fastest plan (or why there is none), and a
/// note for every strategy that did not take part (skipped for size, not applicable) or
/// failed outright (an invalid schedule is a strategy's bug, reported rather than hidden).
#[derive(Debug)]
pub struct BestPlan {
    pub result: Result<Planned, PlanError>,
    /// `(strategy, why)` for strategies skipped or not applicable.
    pub skipped: Vec<(String, String)>,
    /// Strategies that failed with an error other than over budget / not applicable.
    pub failed: Vec<(String, PlanError)>,
}

/// Runs every strategy and keeps the fastest plan under the budget. When none fits, the
/// error states the smallest peak any strategy reached. See [`plan_best_explained`] for
/// the strategies it skipped and the ones that failed.
pub fn plan_best(problem: &Problem) -> Result<Planned, PlanError> {
    plan_best_explained(problem, |_, _, _| {}).result
}

/// [`plan_best`], calling `progress(i, count, name)` before each strategy, and saying
/// which strategies were skipped (too large a graph for their cost, or not applicable) and
/// which failed.
pub fn plan_best_explained(
    problem: &Problem,
    progress: impl FnMut(usize, usize, &str),
) -> BestPlan {
    plan_best_among(&registry(), problem, progress)
}

/// [`plan_best_explained`] over the given strategies.
pub fn plan_best_among(
    strategies: &[Box<dyn Strategy>],
    problem: &Problem,
    mut progress: impl FnMut(usize, usize, &str),
) -> BestPlan {
    let mut best: Option<Planned> = None;
    let mut smallest: Option<(u64, String)> = None;
    let mut skipped = Vec::new();
    let mut failed = Vec::new();
    for (i, strategy) in strategies.iter().enumerate() {
        let name = strategy.name();
        progress(i, strategies.len(), &name);
        if let Some(why) = skipped_in_search(strategy.as_ref(), problem) {
            skipped.push((name, why));
            continue;
        }
        match strategy.plan(problem) {
            Ok(planned) => {
                let faster = best
                    .as_ref()
                    .is_none_or(|b| planned.report.total_time < b.report.total_time);
                if faster {
                    best = Some(planned);
                }
            }
            Err(PlanError::OverBudget {
                best_peak,
                strategy,
                ..
            }) => {
                if smallest.as_ref().is_none_or(|(p, _)| best_peak < *p) {
                    smallest = Some((best_peak, strategy));
                }
            }
            Err(PlanError::NotApplicable { why, .. }) => skipped.push((name, why)),
            // A solver's proof that nothing fits is an answer, not a failure.
            Err(PlanError::ProvedInfeasible { .. }) => {}
            Err(other) => failed.push((name, other)),
        }
    }
    BestPlan {
        result: best.ok_or_else(|| infeasible(problem, smallest)),
        skipped,
        failed,
    }
}

fn infeasible(problem: &Problem, smallest: Option<(u64, String)>) -> PlanError {
    let (best_peak, strategy) =
        smallest.unwrap_or_else(|| (problem.graph.store_all_peak(), "store-all".to_string()));
    PlanError::Infeasible {
        budget: problem.budget_bytes,
        best_peak,
        strategy,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::SimError;

    /// A training chain: `n` forward layers, the loss, `n` backward layers.
    fn chain(n: usize) -> Graph {
        super::baselines::tests::training_chain(n)
    }

    /// A strategy with a bug: its schedule is invalid.
    struct Broken;
    impl Strategy for Broken {
        fn name(&self) -> String {
            "broken".into()
        }
        fn summary(&self) -> &'static str {
            "always invalid"
        }
        fn plan(&self, _: &Problem) -> Result<Planned, PlanError> {
            Err(PlanError::InvalidSchedule {
                strategy: self.name(),
                error: SimError::NeverComputed { node: "x".into() },
            })
        }
    }

    #[test]
    fn a_strategy_with_an_invalid_schedule_is_reported_not_dropped() {
        let g = chain(8);
        let problem = Problem {
            graph: &g,
            budget_bytes: u64::MAX,
            bandwidth: 1.0,
        };
        let strategies: Vec<Box<dyn Strategy>> =
            vec![Box::new(Broken), Box::new(baselines::StoreAll)];
        let best = plan_best_among(&strategies, &problem, |_, _, _| {});
        assert!(best.result.is_ok());
        assert_eq!(best.failed.len(), 1);
        assert_eq!(best.failed[0].0, "broken");
        assert!(best.failed[0].1.to_string().contains("invalid schedule"));
    }

    #[test]
    fn searches_skip_super_linear_strategies_on_large_graphs_and_say_why() {
        let g = chain(CANDIDATE_SEARCH_LIMIT / 2 + 1);
        assert!(g.len() > CANDIDATE_SEARCH_LIMIT && g.len() <= QUADRATIC_PLAN_LIMIT);
        let problem = Problem {
            graph: &g,
            budget_bytes: g.store_all_peak() / 2,
            bandwidth: 1.0,
        };
        let mut seen = Vec::new();
        let best = plan_best_explained(&problem, |_, _, name| seen.push(name.to_string()));
        assert_eq!(seen.len(), registry().len());
        let planned = best.result.expect("a plan fits");
        assert!(planned.report.peak_bytes <= problem.budget_bytes);
        let skipped: Vec<&str> = best.skipped.iter().map(|(n, _)| n.as_str()).collect();
        for name in ["threshold", "chen-greedy", "evict", "mutwo-refined"] {
            assert!(skipped.contains(&name), "{name} not skipped: {skipped:?}");
        }
        for name in ["mutwo", "recompute-all", "sqrt"] {
            assert!(!skipped.contains(&name), "{name} skipped: {skipped:?}");
        }
        let (_, why) = &best.skipped[skipped.iter().position(|n| *n == "threshold").unwrap()];
        assert!(
            why.contains("nodes") && why.contains("--strategy threshold"),
            "{why}"
        );
        assert!(best.failed.is_empty(), "{:?}", best.failed);
        // Asked for by name, a strategy still runs on the same graph.
        assert!(skipped_in_search(&baselines::SqrtN, &problem).is_none());
    }
}
