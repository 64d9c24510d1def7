//! The training data every language model of the engine takes: token ids and their
//! next-token targets. Its own module so that the GPT, the Hugging Face file format
//! ([`super::hf_file`]) and the spec-driven models share it without importing each other.

use std::sync::Arc;

/// A training batch: `tokens` and next-token `targets`, both `[batch, seq]` row-major.
#[derive(Clone, Debug)]
pub struct Batch {
    pub tokens: Arc<[u32]>,
    pub targets: Arc<[u32]>,
    pub batch: usize,
    pub seq: usize,
}
