//! Models built on the graph.

pub mod mlp;
