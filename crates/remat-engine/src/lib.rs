//! remat-engine: tensors, a byte-budgeted memory pool, CPU kernels, autograd and exact
//! activation checkpointing.

pub mod pipeline;
pub mod spec;
pub mod swap;
