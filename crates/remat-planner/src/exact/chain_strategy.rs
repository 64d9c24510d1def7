//! The chain DP as a registered strategy (`chain-dp`).

use super::chain::{MAX_CELLS, solve_chain};
use super::chain_graph::{GraphChain, chain_of, decisions_of};
use crate::error::PlanError;
use crate::strategy::{Planned, Problem, Strategy, plan_from_steps};

/// Memory resolution of the DP: the budget is cut into at most this many units (Rotor uses
/// a few hundred; more costs time linearly and gains only rounding).
pub const MAX_UNITS: usize = 1000;

/// Optimal persistent checkpointing of a chain-shaped training graph.
pub struct ChainDp;

pub const NAME: &str = "chain-dp";

impl Strategy for ChainDp {
    fn name(&self) -> String {
        NAME.into()
    }
    fn summary(&self) -> &'static str {
        "optimal recompute schedule for chain-shaped graphs (Rotor-style DP)"
    }
    fn is_exact(&self) -> bool {
        true
    }
    fn plan(&self, problem: &Problem) -> Result<Planned, PlanError> {
        let graph = problem.graph;
        let mut mapped = chain_of(graph).map_err(|why| PlanError::NotApplicable {
            strategy: NAME.into(),
            why,
        })?;
        let Some(avail) = problem.budget_bytes.checked_sub(graph.static_bytes()) else {
            return Err(over_budget(problem, smallest_peak(&mapped, problem)));
        };
        match best_fit(&mut mapped, problem, avail) {
            Some(planned) => Ok(planned),
            None => Err(over_budget(problem, smallest_peak(&mapped, problem))),
        }
    }
}

/// Solves at the nominal budget `avail`, then re-solves with the slack the rounding left
/// (sizes are rounded up to whole units, so the real peak is usually below the nominal one)
/// and keeps the fastest schedule the simulator confirms under the budget.
fn best_fit(mapped: &mut GraphChain, problem: &Problem, avail: u64) -> Option<Planned> {
    let graph = problem.graph;
    let units = units_for(mapped.forward.len(), MAX_UNITS) as u64;
    let mut nominal = avail;
    let mut best: Option<Planned> = None;
    for _ in 0..4 {
        mapped.chain.unit_bytes = nominal.div_ceil(units).max(1);
        let unit = mapped.chain.unit_bytes;
        let Ok(solution) = solve_chain(&mapped.chain, mapped.chain.budget_units(nominal)) else {
            break;
        };
        let steps = mapped.steps(graph, &solution);
        let decisions = decisions_of(graph, &steps);
        match plan_from_steps(problem, NAME, steps, decisions) {
            Ok(planned) => {
                let slack = problem.budget_bytes - planned.report.peak_bytes;
                if best
                    .as_ref()
                    .is_none_or(|b| planned.report.total_time < b.report.total_time)
                {
                    best = Some(planned);
                }
                if slack < unit {
                    break;
                }
                nominal += slack;
            }
            Err(PlanError::OverBudget { best_peak, .. }) => {
                nominal = nominal.saturating_sub(best_peak - problem.budget_bytes + unit);
            }
            Err(_) => break,
        }
    }
    best
}

/// The most memory units a table for `stages` stages may use.
fn units_for(stages: usize, cap: usize) -> usize {
    let per_unit = 2 * (stages + 1) * (stages + 1);
    (MAX_CELLS / per_unit).saturating_sub(1).clamp(1, cap)
}

fn over_budget(problem: &Problem, best_peak: u64) -> PlanError {
    PlanError::OverBudget {
        strategy: NAME.into(),
        budget: problem.budget_bytes,
        best_peak,
    }
}

/// The least peak the DP reaches: bisection on the budget at a coarse resolution, since it
/// is only reported when the requested budget is infeasible.
fn smallest_peak(mapped: &GraphChain, problem: &Problem) -> u64 {
    let graph = problem.graph;
    let units = units_for(mapped.forward.len(), 400);
    let mut chain = mapped.chain.clone();
    let (mut lo, mut hi) = (
        0u64,
        graph.store_all_peak().saturating_sub(graph.static_bytes()),
    );
    let mut best = None;
    while hi > lo + hi / 1000 + 1 {
        let mid = lo + (hi - lo) / 2;
        chain.unit_bytes = mid.div_ceil(units as u64).max(1);
        match solve_chain(&chain, chain.budget_units(mid)) {
            Ok(solution) => {
                let steps = mapped.steps(graph, &solution);
                if let Ok(report) = crate::sim::simulate_steps(graph, &steps, problem.bandwidth) {
                    best = Some(report.peak_bytes);
                }
                hi = mid;
            }
            Err(_) => lo = mid,
        }
    }
    best.unwrap_or_else(|| graph.store_all_peak())
}
