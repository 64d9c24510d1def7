//! The spec-driven language models, beside the runtime they run on ([`crate::spec::run`]):
//! Qwen3-style dense and MoE decoders ([`qwen3`]), Mamba-1 ([`mamba`]) and models stacking
//! both ([`hybrid`]). Their blocks run through a compiled recompute plan; what they share
//! is here once, so that no model borrows another's:
//!
//! - [`step`]: the training step (embedding, the blocks under their plans, the head,
//!   backward through the plans), what it runs with ([`StepEnv`]) and what it measured
//!   ([`StepStats`]), and the checks of a plan against a stacked model;
//! - [`grads`]: what a step returns ([`SpecGrads`]; each model names it its own way);
//! - `head`: the embedding and the LM head around the blocks;
//! - `lora` and `init`: LoRA adapters and the deterministic initialisation.
//!
//! Arrows: `hybrid -> qwen3, mamba -> step, grads, head, lora, init -> spec::run`; the
//! shared modules import no model.

pub mod grads;
mod head;
pub mod hybrid;
mod init;
mod lora;
pub mod mamba;
pub mod qwen3;
pub mod step;

pub use grads::{GradHolds, SpecGrads};
pub use step::{StepEnv, StepStats};
