//! Models built on the graph.

pub mod gpt;
pub mod mlp;
