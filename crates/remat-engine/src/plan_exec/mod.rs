//! Profile, plan and execute a step of an engine graph: the planner's [`remat_planner::Plan`]
//! run in the engine, one training step by the plan's explicit schedule (`Compute` /
//! `Free` / `SwapOut` / `SwapIn`), not by the graph's own retention policies.
//!
//! The pieces, in the order a step goes through them:
//! - [`Layout`]: the step of an engine [`crate::core::graph::Graph`] unrolled into planner
//!   items (forward ops, backward ops, op workspaces), one tensor each. Its items are the
//!   nodes of the planner graph the profiler emits, so a plan made for that graph indexes
//!   them directly.
//! - [`profile`]: the step run by its store-all schedule and timed, item by item, into the
//!   planner's graph IR; and what copies cost while it computes.
//! - [`choose_plan`]: the fastest predicted plan under the budget among the planner's
//!   strategies and the engine's own policies, skipping plans the executor refuses.
//! - [`run_steps`] / [`run_plan`]: the executor. `Compute` runs an op forward (a first
//!   computation records its random states, a recomputation replays them, so dropout
//!   draws the same mask) or backward (the incoming gradients summed in the engine's
//!   order; a parameter's first gradient becomes its buffer, the next ones are added to
//!   it, as in the engine's own backward). `SwapOut`
//!   queues a copy to the host store on the copy engine's device-to-host worker; `Free`
//!   waits for that copy, then drops the device bytes; `SwapIn` allocates the device bytes
//!   and queues the copy back; the first use waits for it, and every wait is stall time.
//!
//! Gradient buffers are planner nodes (`grad:NAME`, see [`Layout`]) allocated at their first
//! write and kept to the end of the step, so the plan's store-all peak is the engine's own
//! (no buffer is held before its first write). The planner's graph IR cannot mark a node
//! as not recomputable, and a written buffer holds a sum no recomputation can rebuild:
//! [`check_plan`] refuses, before anything runs, a plan that recomputes a written buffer or
//! frees it without a current host copy; [`plan_fits_executor`] lets a caller skip such
//! plans when choosing one.
//!
//! Exactness: every item's tensor owns its storage (views and pass-through gradients are
//! copied), so the pool's live bytes are at every step the static bytes plus the items on
//! the device, as the simulator counts them; with the profiled workspaces the pool's peak
//! equals the simulator's to the byte. Gradients equal those of the engine's store-all
//! backward bit for bit whatever the plan (same thread count).

mod choose;
mod exec;
mod grads;
mod layout;
pub mod profile;
mod tensor_buf;

pub use choose::{
    Choice, Considered, choose_plan, kept_nodes, policy_plan, same_nodes, swap_traffic,
};
pub use exec::{ItemMeasure, RunOptions, StepReport, run_steps};
pub use layout::{Item, ItemKind, Layout, Measured};

use remat_planner::{Plan, Step};

use crate::core::error::EngineError;
use crate::core::graph::Graph;
use crate::core::swap::{CopyEngine, SwapError};

/// What can go wrong executing a plan.
#[derive(Debug, thiserror::Error)]
pub enum PlanExecError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
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
    #[error(
        "plan step {step}: {action} the gradient buffer {item} after a contribution was summed \
         into it would lose that contribution (a written gradient buffer may be swapped out and \
         back, never dropped or recomputed)"
    )]
    GradientLost {
        step: usize,
        item: String,
        action: &'static str,
    },
    #[error("{0}")]
    Invalid(String),
}

/// Refuses a schedule the executor cannot run exactly: one that recomputes a gradient
/// buffer after a backward op wrote it, or frees a written buffer before the end of the step
/// without a host copy made since its last write. Steps naming unknown items are left to
/// the executor, which names them.
pub fn check_plan(layout: &Layout, steps: &[Step]) -> Result<(), PlanExecError> {
    let n = layout.items.len();
    let mut written = vec![false; n];
    let mut host_current = vec![false; n];
    let mut computed = vec![false; n];
    let mut ended = false;
    let lost = |step: usize, item: usize, action: &'static str| PlanExecError::GradientLost {
        step,
        item: layout.items[item].name.clone(),
        action,
    };
    for (k, &step) in steps.iter().enumerate() {
        match step {
            Step::Compute { node } if node < n => {
                match layout.items[node].kind {
                    ItemKind::Grad { .. } if written[node] => {
                        return Err(lost(k, node, "recomputing"));
                    }
                    // Only a backward op's first computation sums into the buffers.
                    ItemKind::Backward { .. } if !computed[node] => {
                        for &i in &layout.items[node].inputs {
                            if matches!(layout.items[i].kind, ItemKind::Grad { .. }) {
                                written[i] = true;
                                host_current[i] = false;
                            }
                        }
                    }
                    ItemKind::End => ended = true,
                    _ => {}
                }
                computed[node] = true;
            }
            Step::SwapOut { tensor } if tensor < n => host_current[tensor] = true,
            Step::Free { tensor }
                if tensor < n && written[tensor] && !ended && !host_current[tensor] =>
            {
                return Err(lost(k, tensor, "freeing"));
            }
            _ => {}
        }
    }
    Ok(())
}

/// Whether the executor runs this plan (see [`check_plan`]): strategies that know nothing
/// of gradient buffers may drop them, and such plans must be skipped when choosing one.
pub fn plan_fits_executor(layout: &Layout, plan: &Plan) -> bool {
    check_plan(layout, &plan.steps).is_ok()
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
