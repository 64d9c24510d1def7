//! remat-engine: tensors, a byte-budgeted memory pool, CPU kernels, autograd and exact
//! activation checkpointing.

pub mod kernels;
pub mod models;
pub mod pipeline;
pub mod spec;
pub mod swap;
