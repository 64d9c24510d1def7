//! Models built on the engine's graph (GPT, MLP, K models fused or multiplexed), and the
//! Hugging Face file format they share. The spec-driven models (Qwen3, Mamba, hybrid) run
//! on the spec runtime instead and live beside it, in [`crate::spec::models`].

pub mod batch;
pub mod fused;
pub mod gpt;
pub mod hf_file;
pub mod mlp;
pub mod multi;
