//! Typed errors. Each names the node, field, step or strategy at fault.
//!
//! A wrapped error is part of the message and deliberately not exposed as
//! [`std::error::Error::source`] (its field is named `error`, not `source`): callers that
//! print the whole chain (`anyhow`'s `{:#}`) would otherwise show its text twice, and
//! callers that print only the top message would otherwise lose the step or field at fault.

use remat_units::{human_bytes, human_bytes_exact};
use thiserror::Error;

/// Kept here too, beside the other errors, for callers that name it by this path.
pub use crate::ir::GraphError;
use crate::ir::NodeId;

/// A graph file that cannot be imported.
#[derive(Debug, Error)]
pub enum ImportError {
    #[error("{file}: cannot read: {error}")]
    Io { file: String, error: std::io::Error },
    #[error("{file}: not valid JSON: {error}")]
    Json {
        file: String,
        error: serde_json::Error,
    },
    #[error("{file}: {what}")]
    Schema { file: String, what: String },
    #[error("{file}: node {node}: field `{field}`: {what}")]
    Field {
        file: String,
        node: String,
        field: String,
        what: String,
    },
    #[error("{file}: link {link}: {what}")]
    Link {
        file: String,
        link: usize,
        what: String,
    },
    #[error("{file}: the graph has a cycle through node {node}: {path}")]
    Cycle {
        file: String,
        node: String,
        path: String,
    },
    #[error("{file}: {error}")]
    Graph { file: String, error: GraphError },
}

/// A schedule that cannot run. `step` is the index in [`crate::plan::Plan::steps`] of the
/// first broken step.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum SimError {
    #[error("step {step}: node {node} does not exist")]
    UnknownNode { step: usize, node: NodeId },
    #[error("step {step}: computing `{node}` needs `{input}`, which is not on the device")]
    InputMissing {
        step: usize,
        node: String,
        input: String,
    },
    #[error("step {step}: computing `{node}`, whose output is already on the device")]
    AlreadyResident { step: usize, node: String },
    #[error("step {step}: freeing `{tensor}`, which is not on the device")]
    FreeMissing { step: usize, tensor: String },
    #[error("step {step}: swapping out `{tensor}`, which is not on the device")]
    SwapOutMissing { step: usize, tensor: String },
    #[error("step {step}: swapping in `{tensor}`, which was never swapped out")]
    SwapInWithoutSwapOut { step: usize, tensor: String },
    #[error("step {step}: swapping in `{tensor}`, which is already on the device")]
    SwapInResident { step: usize, tensor: String },
    #[error(
        "step {step}: computing `{node}` a second time, but it is pinned (computed exactly once: kept or swapped, never recomputed)"
    )]
    PinnedRecomputed { step: usize, node: String },
    #[error(
        "step {step}: computing `{node}` reads the pinned `{tensor}` before its earlier reader `{earlier}` has run (a pinned tensor's readers run in node order: each may write it in place)"
    )]
    PinnedReadOutOfOrder {
        step: usize,
        // Boxed names keep `SimError`, which larger errors carry, at its size.
        node: Box<str>,
        tensor: Box<str>,
        earlier: Box<str>,
    },
    #[error("node `{node}` is never computed by the schedule")]
    NeverComputed { node: String },
    #[error("plan is for a graph of {plan_nodes} nodes, this graph has {graph_nodes}")]
    GraphMismatch {
        plan_nodes: usize,
        graph_nodes: usize,
    },
    #[error("bandwidth {value} bytes/s is not a positive finite number")]
    Bandwidth { value: f64 },
    /// A plan in the eager order ([`crate::plan::PlanOrder::Eager`]) whose steps break
    /// the form ([`crate::eager::check`]).
    #[error("the plan is in the eager order, but {error}")]
    NotEager {
        error: Box<crate::eager::EagerError>,
    },
}

/// Why a strategy produced no plan.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum PlanError {
    #[error(
        "strategy `{strategy}`: budget of {} is infeasible; its smallest peak is {}",
        human_bytes(*budget),
        human_bytes_exact(*best_peak)
    )]
    OverBudget {
        strategy: String,
        budget: u64,
        best_peak: u64,
    },
    #[error(
        "budget of {} is infeasible for every strategy; the smallest peak any strategy reached is {} (by `{strategy}`)",
        human_bytes(*budget),
        human_bytes_exact(*best_peak)
    )]
    Infeasible {
        budget: u64,
        best_peak: u64,
        strategy: String,
    },
    /// The strategy proved that no schedule fits (an exact solver's answer), without a
    /// peak of its own to report.
    #[error("strategy `{strategy}`: budget of {} is infeasible: {why}", human_bytes(*budget))]
    ProvedInfeasible {
        strategy: String,
        budget: u64,
        why: String,
    },
    #[error(
        "budget of {} is below the graph's floor of {} (its largest operation's output plus its inputs, plus static memory): no schedule fits",
        human_bytes(*budget),
        human_bytes_exact(*floor)
    )]
    BelowFloor { budget: u64, floor: u64 },
    /// A recompute-only request under the recompute floor ([`crate::floor`]): no schedule
    /// without swaps fits.
    #[error(
        "budget of {} is below the graph's recompute floor of {} ({}): no schedule without swaps fits",
        human_bytes(*budget),
        human_bytes_exact(*floor),
        crate::floor::floor_kind(*exact)
    )]
    BelowRecomputeFloor {
        budget: u64,
        floor: u64,
        exact: bool,
    },
    /// A budget under the eager floor ([`crate::eager::floor`]) of a graph planned in the
    /// eager order: no eager plan fits.
    #[error(
        "budget of {} is below the graph's eager floor of {} (every value eager autograd holds at some operation, with its inputs and output, plus static memory): no eager-order plan fits",
        human_bytes(*budget),
        human_bytes_exact(*floor)
    )]
    BelowEagerFloor { budget: u64, floor: u64 },
    #[error("strategy `{strategy}` does not apply: {why}")]
    NotApplicable { strategy: String, why: String },
    #[error("unknown strategy `{name}`; known: {known}")]
    UnknownStrategy { name: String, known: String },
    /// A parameterized strategy (`every:N`, ...) with a parameter out of its range.
    #[error("strategy `{name}`: {why}")]
    BadParameter { name: String, why: String },
    #[error("decision for `{tensor}` is inconsistent: {why}")]
    BadDecision { tensor: String, why: String },
    #[error("strategy `{strategy}` produced an invalid schedule: {error}")]
    InvalidSchedule { strategy: String, error: SimError },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrapped_errors_appear_once_in_the_chain() {
        let err = PlanError::InvalidSchedule {
            strategy: "s".into(),
            error: SimError::NeverComputed { node: "n".into() },
        };
        let text = err.to_string();
        assert_eq!(text.matches("never computed").count(), 1, "{text}");
        assert!(std::error::Error::source(&err).is_none());
    }
}
