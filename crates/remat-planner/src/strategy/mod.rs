//! The [`Strategy`] trait and the strategies that think per tensor: the baselines and MuTWO.
//!
//! A [`Strategy`] turns a [`Problem`] (graph, budget, bandwidth) into a
//! [`crate::problem::Planned`] through [`crate::problem`]'s
//! `plan_from_decisions` or `plan_from_steps`; what one costs in time ([`SearchCost`]) is
//! how the search ([`crate::search`]) decides whether it fits the time left. The registry of
//! every strategy, the exact ones ([`crate::exact`]) and the anytime solver
//! ([`crate::solve`]) included, is [`crate::registry`](mod@crate::registry).

pub mod baselines;
pub mod mutwo;

use std::time::Instant;

use crate::error::PlanError;
use crate::problem::{Planned, Problem};

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
    /// [`Strategy::plan`] under a deadline: a strategy that can stop early does so there,
    /// returning its best plan so far, or [`PlanError::NotApplicable`] saying it ran out of
    /// time. The default ignores the deadline (for strategies that take one pass).
    fn plan_until(&self, problem: &Problem, deadline: Instant) -> Result<Planned, PlanError> {
        let _ = deadline;
        self.plan(problem)
    }
    /// How its running time grows with the graph, so a search under a time limit skips it
    /// when it cannot finish in the time left ([`crate::search::estimated_seconds`]). Asked for by name,
    /// a strategy always runs.
    fn search_cost(&self) -> SearchCost {
        SearchCost::LINEAR
    }
}

/// A strategy's running time, in passes over the graph: `passes * (n / 1000)^(exponent - 1)`
/// times the measured time of one linear pass (lowering and simulating store-all).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SearchCost {
    pub passes: f64,
    pub exponent: i32,
    /// Why it costs that much, for the note of a search that skips it.
    pub why: &'static str,
}

impl SearchCost {
    pub const LINEAR: SearchCost = SearchCost {
        passes: 1.0,
        exponent: 1,
        why: "one pass over the graph",
    };
    /// A strategy that stops at its deadline ([`Strategy::plan_until`]) with its best plan
    /// so far: never skipped for time.
    pub const UNTIL_DEADLINE: SearchCost = SearchCost {
        passes: 1.0,
        exponent: 1,
        why: "it stops at the time limit with its best plan so far",
    };
    /// A strategy whose one solve cannot stop midway (a dynamic-programming table of up to
    /// a quarter of a second) but whose refinements stop at its deadline: a search runs it
    /// after the others, so that it cannot take their share.
    pub const TABLE: SearchCost = SearchCost {
        passes: 1.0,
        exponent: 1,
        why: "one dynamic-programming table, then refinements until the deadline",
    };
}
