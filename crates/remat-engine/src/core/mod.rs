//! The engine's core: what every model and every runtime above it is built from. Nothing
//! here knows a model, a spec, a plan or a pipeline.
//!
//! In reading order:
//! - memory: [`dtype`], [`tensor`] (a typed buffer charged to a pool), [`pool`] (the
//!   byte-budgeted memory pool and its categories, with freed buffers kept for reuse; the
//!   buffer and the category have small modules of their own, so that pool, tensor and
//!   error import none of each other in a circle),
//!   [`swap`] (the host store and the copy engine that moves tensors to it and back);
//! - compute: [`kernels`] (CPU kernels, forward and backward side by side), [`linalg`]
//!   (matrix multiply), [`elementwise`] (the loops the basic ops share), [`rng`] (the
//!   counter-based generator random ops draw from and replay);
//! - autograd: [`op`] (the op abstraction), [`ops`] (one op per file), [`graph`] (recording,
//!   forward, backward, rebuilds), [`context`] (the pool and threads a graph runs on),
//!   [`error`];
//! - checkpointing: [`checkpoint`] (what a node keeps for backward), [`policy`] (a whole
//!   graph's retention at once);
//! - training and checks: [`optim`] (AdamW), [`gradcheck`] (finite differences).
//!
//! The engine's common types are re-exported at the crate root ([`crate::Tensor`],
//! [`crate::Graph`], [`crate::MemoryPool`], ...).

mod buf;
mod buffer_cache;
mod category;
pub mod checkpoint;
pub mod context;
pub mod dtype;
pub mod elementwise;
pub mod error;
pub mod gradcheck;
pub mod graph;
pub mod kernels;
pub mod linalg;
pub mod op;
pub mod ops;
pub mod optim;
pub mod policy;
pub mod pool;
pub mod rng;
pub mod swap;
pub mod tensor;
