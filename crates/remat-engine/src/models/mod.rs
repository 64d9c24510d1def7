//! Models built on the graph, and spec-driven Qwen3 blocks built from the kernels.

pub mod gpt;
pub mod hf_file;
pub mod mlp;
pub mod qwen3;
