//! The chain DP as a registered strategy (`chain-dp`).
//!
//! The DP counts memory in whole units. When one unit can divide every byte quantity of
//! the chain (their gcd, [`ByteChain::lossless_unit`]) and the budget in those units fits
//! the work limit, rounding loses nothing and the plan is the optimum over persistent
//! schedules: [`Strategy::is_exact_for`] says so. Otherwise the budget is cut into as many
//! units as the work limit allows (sizes rounded up, so plans stay feasible) and the plan
//! is a close approximation; below [`MIN_UNITS`] units it would be a poor one (a handful of
//! units wastes most of the budget), so the strategy declines rather than plan badly.
//! Real profiled graphs have gcds of a few KiB against budgets of GiB, so in practice the
//! DP is exact only on small or unit-size chains and within one unit elsewhere.

use std::time::Instant;

use super::chain::{ByteChain, MAX_CELLS, fill_work, solve_chain, solve_chain_least};
use super::chain_graph::{GraphChain, chain_of, decisions_of};
use crate::error::PlanError;
use crate::problem::{Planned, Problem, plan_from_steps};
use crate::strategy::Strategy;

/// Inner-loop iterations one table fill may take: about a quarter of a second in a
/// release build, so a plan (at most `MAX_SOLVES` fills) stays around a second.
pub const MAX_WORK: f64 = 1.5e8;
/// Most memory units when rounding is lossy: one unit is then under 0.03% of the budget,
/// and more would cost table memory and time for nothing visible.
pub const MAX_UNITS: usize = 4096;
/// Fewest memory units worth solving with when rounding is lossy.
pub const MIN_UNITS: usize = 64;
/// Fills per plan: the nominal budget, then re-solves with the slack rounding left.
const MAX_SOLVES: usize = 4;

/// Optimal persistent checkpointing of a chain-shaped training graph.
pub struct ChainDp;

pub const NAME: &str = "chain-dp";

impl Strategy for ChainDp {
    fn name(&self) -> String {
        NAME.into()
    }
    fn summary(&self) -> &'static str {
        "optimal recompute schedule for chain-shaped graphs (Rotor-style DP); exact when byte sizes discretize losslessly, else within one memory unit"
    }
    fn is_exact(&self) -> bool {
        true
    }
    fn is_exact_for(&self, problem: &Problem) -> bool {
        let Ok(mapped) = chain_of(problem.graph) else {
            return false;
        };
        let avail = problem
            .budget_bytes
            .checked_sub(problem.graph.static_bytes());
        avail.is_some_and(|a| resolution(&mapped.chain, a).is_ok_and(|r| r.lossless))
    }
    fn search_cost(&self) -> crate::strategy::SearchCost {
        crate::strategy::SearchCost::TABLE
    }
    fn plan(&self, problem: &Problem) -> Result<Planned, PlanError> {
        plan_by(problem, None)
    }
    /// Each table fill takes up to about a quarter of a second ([`MAX_WORK`]); after the
    /// first, the re-solves with the slack rounding left stop at the deadline.
    fn plan_until(&self, problem: &Problem, deadline: Instant) -> Result<Planned, PlanError> {
        plan_by(problem, Some(deadline))
    }
}

/// The chain DP's plan, re-solving with the slack rounding left until `deadline` if any.
fn plan_by(problem: &Problem, deadline: Option<Instant>) -> Result<Planned, PlanError> {
    let graph = problem.graph;
    let not_applicable = |why| PlanError::NotApplicable {
        strategy: NAME.into(),
        why,
    };
    let mut mapped = chain_of(graph).map_err(not_applicable)?;
    let Some(avail) = problem.budget_bytes.checked_sub(graph.static_bytes()) else {
        return Err(over_budget(problem, smallest_peak(&mapped, problem)));
    };
    let res = resolution(&mapped.chain, avail).map_err(not_applicable)?;
    match best_fit(&mut mapped, problem, avail, res, deadline) {
        Some(planned) => Ok(planned),
        None => Err(over_budget(problem, smallest_peak(&mapped, problem))),
    }
}

/// How the DP counts memory for one budget.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Resolution {
    pub units: usize,
    /// Whether sizes are whole numbers of units (the DP is then exact in bytes).
    pub lossless: bool,
}

/// The resolution for `avail` bytes: lossless when the table for it fits the limits, else
/// the most units the limits allow, refused below [`MIN_UNITS`].
pub fn resolution(chain: &ByteChain, avail: u64) -> Result<Resolution, String> {
    let stages = chain.state_bytes.len().saturating_sub(1);
    let cap = max_units(stages);
    let exact_units = avail / chain.lossless_unit();
    if exact_units <= cap as u64 {
        return Ok(Resolution {
            units: exact_units as usize,
            lossless: true,
        });
    }
    if cap < MIN_UNITS {
        return Err(format!(
            "a chain of {stages} stages leaves room for {cap} memory units within the DP's work limit; at least {MIN_UNITS} are needed for a useful plan"
        ));
    }
    Ok(Resolution {
        units: cap.min(MAX_UNITS),
        lossless: false,
    })
}

/// The most memory units a table for `stages` stages may use: within [`MAX_CELLS`] and
/// [`MAX_WORK`].
fn max_units(stages: usize) -> usize {
    let by_cells = (MAX_CELLS / (2 * (stages + 1) * (stages + 1))).saturating_sub(1);
    let per_unit = fill_work(stages, 1) / 2.0;
    let by_work = (MAX_WORK / per_unit.max(1.0)) as usize;
    by_cells.min(by_work.saturating_sub(1))
}

/// Solves at the nominal budget `avail`. When rounding is lossy, re-solves with the slack
/// it left (sizes are rounded up, so the real peak is usually below the nominal one) and
/// keeps the fastest schedule the simulator confirms under the budget.
fn best_fit(
    mapped: &mut GraphChain,
    problem: &Problem,
    avail: u64,
    res: Resolution,
    deadline: Option<Instant>,
) -> Option<Planned> {
    let graph = problem.graph;
    if res.lossless {
        mapped.chain.unit_bytes = mapped.chain.lossless_unit();
        let solution = solve_chain(&mapped.chain, res.units).ok()?;
        let steps = mapped.steps(graph, &solution);
        let decisions = decisions_of(graph, &steps);
        return plan_from_steps(problem, NAME, steps, decisions).ok();
    }
    let units = res.units as u64;
    let mut nominal = avail;
    let mut best: Option<Planned> = None;
    for _ in 0..MAX_SOLVES {
        // The first fill always runs (a plan is better than none); later ones only refine.
        if best.is_some() && deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
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

fn over_budget(problem: &Problem, best_peak: u64) -> PlanError {
    PlanError::OverBudget {
        strategy: NAME.into(),
        budget: problem.budget_bytes,
        best_peak,
    }
}

/// The least peak the DP reaches, reported when the requested budget is infeasible: one
/// table over budgets up to the store-all peak gives the least feasible budget directly,
/// and the simulator measures its schedule.
fn smallest_peak(mapped: &GraphChain, problem: &Problem) -> u64 {
    let graph = problem.graph;
    let top = graph.store_all_peak().saturating_sub(graph.static_bytes());
    let mut chain = mapped.chain.clone();
    let units = match resolution(&chain, top) {
        Ok(Resolution {
            units,
            lossless: true,
        }) => {
            chain.unit_bytes = chain.lossless_unit();
            units
        }
        Ok(Resolution { units, .. }) => {
            chain.unit_bytes = top.div_ceil(units as u64).max(1);
            chain.budget_units(top)
        }
        Err(_) => return graph.store_all_peak(),
    };
    solve_chain_least(&chain, units)
        .ok()
        .and_then(|(_, solution)| {
            let steps = mapped.steps(graph, &solution);
            crate::sim::simulate_steps(graph, &steps, problem.bandwidth).ok()
        })
        .map_or_else(|| graph.store_all_peak(), |r| r.peak_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Past its deadline the chain DP still makes its first fill (a plan is better than none)
    /// and stops refining: the plan fits, and it is no faster than the unhurried one.
    #[test]
    fn a_passed_deadline_keeps_the_first_fill() {
        let g = crate::strategy::baselines::tests::training_chain(40);
        let budget = g.static_bytes() + (g.store_all_peak() - g.static_bytes()) / 3;
        let problem = Problem {
            graph: &g,
            budget_bytes: budget,
            bandwidth: 1.0,
        };
        let hurried = ChainDp
            .plan_until(&problem, std::time::Instant::now())
            .unwrap();
        let unhurried = ChainDp.plan(&problem).unwrap();
        assert!(hurried.report.peak_bytes <= budget);
        assert!(hurried.report.total_time >= unhurried.report.total_time);
    }
}
