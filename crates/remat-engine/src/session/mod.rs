//! Training sessions: the product's main flow, profile -> plan -> execute, as a library.
//!
//! The `remat` command (`remat train`, `remat profile`, `remat spec inspect`) and the
//! benchmarks (`remat-bench`) drive the same sessions, so what a benchmark measures is
//! what a user runs, and neither front end reaches into the other.
//!
//! - [`auto`]: profile a recorded step, plan it for a memory budget (every planner
//!   strategy and the engine's fixed policies weighed), run every later step by the plan
//!   ([`auto::AutoSession`]).
//! - [`multiplexed`]: K models' step planned as one multiplexed graph, so one model's swaps
//!   hide behind another model's compute.
//! - [`models`]: K GPT models trained together on one pool, each with its own optimizer,
//!   data order and hyper-parameters, fused where their shapes match.
//! - [`task`]: the training data: the embedded sequence-reversal task, or characters of a
//!   text file.
//! - [`model`]: an engine model (GPT or MLP) built from a few numbers, with a deterministic
//!   batch, recorded and profiled.
//! - [`spec_mix`]: the mix of keep, recompute and offload per layer of a spec-driven model,
//!   profiled and tuned for a budget.
//! - [`spec_train`]: a spec-driven model (Qwen3, Mamba, hybrid) trained under its compiled
//!   plans, or the mix chosen for a budget, with AdamW over its named buffers.
//!
//! Errors are [`SessionError`]s; messages name the flag or setting at fault as the `remat`
//! command spells it.

pub mod auto;
mod error;
pub mod model;
pub mod models;
pub mod multiplexed;
pub mod spec_mix;
pub mod spec_train;
pub mod task;

pub use error::{Result, SessionError};
