//! Typed errors. Each names the node, field, step or strategy at fault.

use thiserror::Error;

use crate::ir::NodeId;

/// A graph that breaks an IR invariant.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum GraphError {
    #[error("node `{node}`: input {input} does not exist")]
    MissingInput { node: String, input: String },
    #[error("node `{node}`: input {input} comes at or after it, so the order is not topological")]
    NotTopological { node: String, input: String },
    #[error("node `{node}`: input {input} is listed twice")]
    DuplicateInput { node: String, input: NodeId },
    #[error("node `{node}`: field `{field}` is {value}, it must be finite and non-negative")]
    Cost {
        node: String,
        field: &'static str,
        value: f64,
    },
    #[error("time unit {value} s is not a positive finite number")]
    TimeUnit { value: f64 },
}

/// A graph file that cannot be imported.
#[derive(Debug, Error)]
pub enum ImportError {
    #[error("{file}: cannot read: {source}")]
    Io {
        file: String,
        source: std::io::Error,
    },
    #[error("{file}: not valid JSON: {source}")]
    Json {
        file: String,
        source: serde_json::Error,
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
    #[error("{file}: the graph has a cycle through node {node}")]
    Cycle { file: String, node: String },
    #[error("{file}: {source}")]
    Graph { file: String, source: GraphError },
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
    #[error("node `{node}` is never computed by the schedule")]
    NeverComputed { node: String },
    #[error("plan is for a graph of {plan_nodes} nodes, this graph has {graph_nodes}")]
    GraphMismatch {
        plan_nodes: usize,
        graph_nodes: usize,
    },
    #[error("bandwidth {value} bytes/s is not a positive finite number")]
    Bandwidth { value: f64 },
}

/// Why a strategy produced no plan.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum PlanError {
    #[error(
        "strategy `{strategy}`: budget of {budget} bytes is infeasible; its smallest peak is {best_peak} bytes"
    )]
    OverBudget {
        strategy: String,
        budget: u64,
        best_peak: u64,
    },
    #[error(
        "budget of {budget} bytes is infeasible for every strategy; the smallest peak any strategy reached is {best_peak} bytes (by `{strategy}`)"
    )]
    Infeasible {
        budget: u64,
        best_peak: u64,
        strategy: String,
    },
    #[error("strategy `{strategy}` does not apply: {why}")]
    NotApplicable { strategy: String, why: String },
    #[error("unknown strategy `{name}`; known: {known}")]
    UnknownStrategy { name: String, known: String },
    #[error("decision for `{tensor}` is inconsistent: {why}")]
    BadDecision { tensor: String, why: String },
    #[error("strategy `{strategy}` produced an invalid schedule: {source}")]
    InvalidSchedule { strategy: String, source: SimError },
}
