//! Execute a planner [`Plan`](remat_planner::Plan) in the engine: one training step run by
//! the plan's explicit schedule (`Compute` / `Free` / `SwapOut` / `SwapIn`), not by the
//! graph's own retention policies.
//!
//! The pieces:
//! - [`Layout`]: the step of an engine [`Graph`](crate::graph::Graph) unrolled into planner
//!   items (forward ops, backward ops, op workspaces), one tensor each. Its items are the
//!   nodes of the planner graph the profiler ([`crate::profile`]) emits, so a plan made for
//!   that graph indexes them directly.
//! - [`run_steps`] / [`run_plan`]: the executor. `Compute` runs an op forward (a first
//!   computation records its random states, a recomputation replays them, so dropout
//!   draws the same mask) or backward (the incoming gradients summed in the engine's
//!   order; parameter gradients added to buffers allocated when the step starts). `SwapOut`
//!   queues a copy to the host store on the copy engine's device-to-host worker; `Free`
//!   waits for that copy, then drops the device bytes; `SwapIn` allocates the device bytes
//!   and queues the copy back; the first use waits for it, and every wait is stall time.
//!
//! Exactness: every item's tensor owns its storage (views and pass-through gradients are
//! copied), so the pool's live bytes are at every step the static bytes plus the items on
//! the device, as the simulator counts them; with the profiled workspaces the pool's peak
//! equals the simulator's to the byte. Gradients equal those of the engine's store-all
//! backward bit for bit whatever the plan (same thread count).

mod exec;
mod grads;
mod layout;
mod tensor_buf;

pub use exec::{ItemMeasure, RunOptions, StepReport, run_steps};
pub use layout::{Item, ItemKind, Layout, Measured};

use remat_planner::Plan;

use crate::error::EngineError;
use crate::graph::Graph;
use crate::swap::{CopyEngine, SwapError};

/// What can go wrong executing a plan.
#[derive(Debug, thiserror::Error)]
pub enum PlanExecError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("host store: {0}")]
    Swap(#[from] SwapError),
    #[error(transparent)]
    Planner(#[from] remat_planner::PlanError),
    #[error("the loss node #{index} cannot end a training step: {reason}")]
    BadLoss { index: usize, reason: &'static str },
    #[error(
        "plan is for graph `{plan_graph}` with {plan_nodes} nodes, but this step has {items} \
         items (graph `{graph}`): profile the model again and re-plan"
    )]
    PlanMismatch {
        plan_graph: String,
        plan_nodes: usize,
        graph: String,
        items: usize,
    },
    #[error("plan step {step} names tensor {item}, but the step has only {items} items")]
    UnknownItem {
        step: usize,
        item: usize,
        items: usize,
    },
    #[error("plan step {step}: {item} needs {input}, which is not on the device")]
    NotResident {
        step: usize,
        item: String,
        input: String,
    },
    #[error("plan step {step}: {item} is already on the device")]
    AlreadyResident { step: usize, item: String },
    #[error("plan step {step}: {item} is swapped in but has no copy on the host")]
    NotOnHost { step: usize, item: String },
    #[error("plan step {step} swaps {item}, but no host store was given (use a CopyEngine)")]
    NoHostStore { step: usize, item: String },
    #[error("{0}")]
    Invalid(String),
}

/// Runs one training step of `graph` by `plan`, which must have been made for `layout`'s
/// planner graph (named `graph_name`).
pub fn run_plan(
    graph: &mut Graph,
    layout: &Layout,
    graph_name: &str,
    plan: &Plan,
    copy: Option<&CopyEngine>,
) -> Result<StepReport, PlanExecError> {
    if plan.node_count != layout.len() || plan.graph != graph_name {
        return Err(PlanExecError::PlanMismatch {
            plan_graph: plan.graph.clone(),
            plan_nodes: plan.node_count,
            graph: graph_name.to_string(),
            items: layout.len(),
        });
    }
    run_steps(graph, layout, &plan.steps, copy, RunOptions::default())
}
