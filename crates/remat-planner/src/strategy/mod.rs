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
    if let Some(strategy) = baselines::parse(name) {
        return Ok(strategy);
    }
    registry()
        .into_iter()
        .find(|s| s.name() == name)
        .ok_or_else(|| PlanError::UnknownStrategy {
            name: name.to_string(),
            known: registry()
                .iter()
                .map(|s| s.name())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// Runs every strategy and keeps the fastest plan under the budget. When none fits, the
/// error states the smallest peak any strategy reached.
pub fn plan_best(problem: &Problem) -> Result<Planned, PlanError> {
    let mut best: Option<Planned> = None;
    let mut smallest: Option<(u64, String)> = None;
    for strategy in registry() {
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
            Err(_) => {}
        }
    }
    best.ok_or_else(|| infeasible(problem, smallest))
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
