//! Errors of running a compiled spec: each names the layer, slot or op involved.

use thiserror::Error;

use crate::kernels::KernelError;
use crate::spec::SpecError;

#[derive(Debug, Error)]
pub enum RunError {
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error("op `{op}` (producing {slot}): {source}")]
    Kernel {
        op: String,
        slot: String,
        #[source]
        source: KernelError,
    },
    #[error("op `{op}` (producing {slot}): {reason}")]
    BadOperands {
        op: String,
        slot: String,
        reason: String,
    },
    #[error("layer {layer}: slot `{slot}`: {reason}")]
    Slot {
        layer: usize,
        slot: String,
        reason: String,
    },
    #[error(
        "layer {layer}: the spec drifted from the forward code at slot `{slot}`: the spec says {spec}, the forward did {forward}"
    )]
    Drift {
        layer: usize,
        slot: String,
        spec: String,
        forward: String,
    },
    #[error("model: {0}")]
    Model(String),
}

pub type RunResult<T> = std::result::Result<T, RunError>;
