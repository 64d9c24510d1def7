//! Models built from the engine's kernels.

pub mod qwen3;
