//! Exact and fast planners.
//!
//! - [`revolve`]: Griewank's binomial checkpointing in closed form
//!   ([`revolve::min_forward_steps`]).
//! - [`chain`]: the chain dynamic program ([`chain::solve_chain`]) over any
//!   [`chain::ChainModel`]: [`chain::RevolveChain`] (Griewank's model, where it reaches the
//!   closed form) and [`chain::ByteChain`] (heterogeneous times and byte sizes, accounted as
//!   the simulator does).
//! - [`chain_graph`]: maps a training graph whose forward pass is a chain onto a
//!   [`chain::ByteChain`] and the DP's schedule back to plan steps.
//! - [`chain_strategy::ChainDp`] (`chain-dp`): the DP as a registered strategy.
//! - [`chain_offload::ChainOffload`] (`chain-offload`): the DP with offloaded checkpoints
//!   (recompute and swap combined), never slower than `chain-dp`.
//! - [`evict::Evict`] (`evict`): the fast general-graph strategy (greedy eviction with
//!   look-ahead plus a local search), milliseconds on hundreds of nodes.
//! - `milp::CheckmateMilp` (`checkmate-milp`, cargo feature `milp`): Checkmate's MILP solved
//!   by HiGHS, the ground truth on small graphs.
//!
//! All of them emit explicit schedules (`Compute` / `Free` steps) that the simulator checks
//! through [`crate::problem::plan_from_steps`].

pub mod chain;
pub mod chain_graph;
pub mod chain_offload;
pub mod chain_strategy;
pub mod evict;
#[cfg(feature = "milp")]
pub mod milp;
pub mod revolve;

use crate::strategy::Strategy;

/// The strategies of this module, for the registry.
pub fn strategies() -> Vec<Box<dyn Strategy>> {
    let all: Vec<Box<dyn Strategy>> = vec![
        Box::new(evict::Evict),
        Box::new(chain_strategy::ChainDp),
        Box::new(chain_offload::ChainOffload),
    ];
    #[cfg(feature = "milp")]
    let all = {
        let mut all = all;
        all.push(Box::new(milp::CheckmateMilp {
            options: milp::MilpOptions::default(),
        }));
        all
    };
    all
}
