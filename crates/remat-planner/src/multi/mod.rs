//! Multi-model training, MuTWO's setting (Purandare et al., "mu-TWO: 3x Faster Multi-Model
//! Training with Orchestration and Memory Optimization", MLSys 2023): K models trained
//! together in one step on one device, under one budget, with one model's swaps hidden
//! behind another model's compute.
//!
//! - [`Multiplexed`] ([`graph`]): one planner graph holding the K models' training steps,
//!   with a model label per node. Built by [`Multiplexed::union`] from K graphs, or by
//!   [`Multiplexed::from_labels`] from one graph and a label per node (`None` for a node
//!   several models share, such as a horizontally fused op): the engine's way in.
//! - [`Order`] and [`Interleaving`] ([`order`]): a topological order of the combined graph.
//!   [`Order::Interleaved`] is MuTWO's multiplexing: model `i`'s backward beside model
//!   `i + 1`'s forward, merged by progress, so that the memory one frees the other takes and
//!   each model's prefetches have the other's compute to hide behind. Every order keeps each
//!   model's own node order.
//! - [`plan()`] ([`mod@plan`]): MuTWO's Algorithm B with Algorithm C in full over the interleaved
//!   order (a prefetch walks back over whichever model's nodes run before its use, forward
//!   or backward, and stops at the peak interval), or any other strategy, the general solver
//!   included; the result is an ordinary [`crate::Plan`] over the given graph's nodes, plus
//!   [`report`]: which model's compute overlaps which swap, and the exposed stall per swap
//!   and per model.
//!
//! The steps of a multiplexed plan name the nodes of the graph the [`Multiplexed`] was made
//! from ([`Multiplexed::graph`]), so an executor of that graph runs them as they are.

pub mod graph;
pub mod order;
pub mod plan;
pub mod report;

pub use graph::Multiplexed;
pub use order::{Interleaving, Order};
pub use plan::{MultiPlanned, MultiRequest, plan, plan_each_alone};
pub use report::{ModelStall, SwapHiding};

use thiserror::Error;

use crate::error::SimError;
use crate::ir::GraphError;
use crate::request::RequestError;

/// Why K models cannot be multiplexed or planned together.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum MultiError {
    #[error("no graphs to train together: give at least one")]
    NoGraphs,
    #[error("{labels} model labels for a graph of {nodes} nodes: give one per node")]
    LabelCount { labels: usize, nodes: usize },
    #[error("no node carries a model label: label each model's nodes 0, 1, ...")]
    NoModels,
    #[error(
        "model {model} has no nodes, but labels go up to model {last}: number the models 0 to {last} without gaps"
    )]
    EmptyModel { model: usize, last: usize },
    #[error("model {model} (`{name}`): {error}")]
    Model {
        model: usize,
        name: String,
        error: GraphError,
    },
    #[error("the combined graph of {models} models: {error}")]
    Combined { models: usize, error: GraphError },
    #[error(
        "budget of {} is below the floor of the {models} models together, {} (static memory of all of them plus the largest operation's inputs and output): no schedule fits",
        remat_units::human_bytes(*budget),
        remat_units::human_bytes_exact(*floor)
    )]
    BelowFloor {
        budget: u64,
        floor: u64,
        models: usize,
    },
    #[error("planning the {models} models together: {error}")]
    Plan { models: usize, error: RequestError },
    #[error("planning model {model} (`{name}`) alone: {error}")]
    Alone {
        model: usize,
        name: String,
        error: RequestError,
    },
    /// The plan, mapped back onto the given graph's nodes, does not replay: a bug of the
    /// mapping, reported rather than hidden.
    #[error("the multiplexed plan does not replay on the given graph: {error}")]
    Replay { error: SimError },
}
