//! Models built on the graph, and spec-driven Qwen3 and Mamba blocks built from the kernels.

pub mod fused;
pub mod gpt;
pub mod hf_file;
pub mod hybrid;
pub mod mamba;
pub mod mlp;
pub mod multi;
pub mod qwen3;
mod spec_lora;
mod spec_step;
