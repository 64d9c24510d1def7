//! What to plan for, and what a plan is worth: the [`Problem`] (graph, budget, bandwidth)
//! every strategy takes, the [`Planned`] it returns (the plan with the simulator's report
//! of it), and the one way a strategy turns its answer into a [`Planned`].
//!
//! Strategies that think per tensor (the baselines, MuTWO) build [`Decision`]s and call
//! [`plan_from_decisions`], which lowers them with [`crate::lower::lower`] and checks the
//! result with the simulator; schedule-native strategies (the exact ones, the anytime
//! solver) build steps and call [`plan_from_steps`]. Both return [`PlanError::OverBudget`]
//! with the plan's peak when it does not fit, so callers can report the smallest peak
//! reached. [`check_floor`] refuses a budget no schedule can meet before anything runs.

use crate::error::PlanError;
use crate::ir::Graph;
use crate::lower::{Helpers, lower_with};
use crate::plan::{Decision, PLAN_FORMAT_VERSION, Plan, PlanOrder, Step};
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

/// The bandwidth a recompute-only request plans at
/// ([`crate::request::plan_recompute_only`]): a swap of one byte costs a second, so any plan
/// that recomputes instead is faster, and a plan without swaps runs the same at every
/// bandwidth.
pub const RECOMPUTE_ONLY_BANDWIDTH: f64 = 1.0;

impl Problem<'_> {
    /// Whether swaps are ruled out: the link is no faster than
    /// [`RECOMPUTE_ONLY_BANDWIDTH`]. Solvers then spend no time on swap plans, and a plan
    /// that swaps is only a last resort (it says how many bytes recomputation left over).
    pub fn recompute_only(&self) -> bool {
        self.bandwidth <= RECOMPUTE_ONLY_BANDWIDTH
    }
}

/// A plan together with the simulator's measurements of it.
#[derive(Clone, Debug)]
pub struct Planned {
    pub plan: Plan,
    pub report: SimReport,
}

/// Refuses a budget under the graph's memory floor ([`Graph::memory_floor`]), naming it:
/// no schedule fits there, whatever the strategy.
pub fn check_floor(problem: &Problem) -> Result<(), PlanError> {
    let floor = problem.graph.memory_floor();
    if problem.budget_bytes < floor {
        return Err(PlanError::BelowFloor {
            budget: problem.budget_bytes,
            floor,
        });
    }
    // In the eager order the held values raise the floor ([`crate::eager::floor`]).
    if problem.graph.order_is_eager() {
        let floor = crate::eager::floor(problem.graph);
        if problem.budget_bytes < floor {
            return Err(PlanError::BelowEagerFloor {
                budget: problem.budget_bytes,
                floor,
            });
        }
    }
    Ok(())
}

/// Refuses a budget under the graph's recompute floor ([`crate::floor::recompute_floor`]),
/// naming it: no schedule without swaps fits there. For recompute-only requests; with swaps
/// the floor is [`check_floor`]'s.
pub fn check_recompute_floor(problem: &Problem) -> Result<(), PlanError> {
    let floor = crate::floor::recompute_floor(problem.graph);
    if problem.budget_bytes < floor.bytes {
        return Err(PlanError::BelowRecomputeFloor {
            budget: problem.budget_bytes,
            floor: floor.bytes,
            exact: floor.exact,
        });
    }
    Ok(())
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
///
/// A graph planned in the eager order ([`Graph::with_eager_order`]) gets the schedule
/// checked against the form's rules ([`crate::eager::check`]) and, when it breaks one, put
/// into the form first ([`crate::eager::conform`]) and checked again; its decisions are read
/// off the steps kept, and only then is it simulated: every strategy comes through here, so
/// every plan of an eager request is an eager plan, and a schedule the form cannot take is
/// reported as not applicable.
pub fn plan_from_steps(
    problem: &Problem,
    strategy: &str,
    steps: Vec<Step>,
    decisions: Vec<Decision>,
) -> Result<Planned, PlanError> {
    let (steps, decisions) = if problem.graph.order_is_eager() {
        in_eager_form(problem.graph, strategy, steps)?
    } else {
        (steps, decisions)
    };
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
        order: PlanOrder::of(problem.graph),
        steps,
        decisions,
    };
    Ok(Planned { plan, report })
}

/// `steps` in the eager form, checked, with the decisions they make. Steps already in the
/// form are taken as they are, not conformed again: conform rebuilds lazily (right before
/// the first computation that needs a value), so it would move a recomputation the search
/// put before a copy back after it, and the simulator issues steps in order; the search's
/// polishing steps, which judge each change of an eager plan here, lost their copies back's
/// placement that way (8 layers, eager floor + 5%: a plan of 27.59% judged 37.98%).
fn in_eager_form(
    graph: &Graph,
    strategy: &str,
    steps: Vec<Step>,
) -> Result<(Vec<Step>, Vec<Decision>), PlanError> {
    if crate::eager::check(graph, &steps).is_ok() {
        let decisions = crate::eager::decisions(graph, &steps);
        return Ok((steps, decisions));
    }
    let eager = crate::eager::conform(graph, &steps).map_err(|e| PlanError::NotApplicable {
        strategy: strategy.to_string(),
        why: format!("its schedule has no eager-order form: {e}"),
    })?;
    crate::eager::check(graph, &eager).map_err(|error| PlanError::InvalidSchedule {
        strategy: strategy.to_string(),
        error: crate::error::SimError::NotEager {
            error: Box::new(error),
        },
    })?;
    let decisions = crate::eager::decisions(graph, &eager);
    Ok((eager, decisions))
}
