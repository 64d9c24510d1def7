//! Errors of running a compiled spec: each names the layer, slot or op involved.

use thiserror::Error;

use crate::core::kernels::KernelError;
use crate::spec::SpecError;

#[derive(Debug, Error)]
pub enum RunError {
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error("op `{op}` (producing {slot}): {error}")]
    Kernel {
        op: String,
        slot: String,
        error: KernelError,
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
    /// A produced tensor does not match the slot the compiled plan declares.
    #[error(
        "layer {layer}: slot `{slot}`: {}",
        describe_mismatch(.declared, *.declared_bytes, .actual, *.actual_bytes)
    )]
    ShapeMismatch {
        layer: usize,
        slot: String,
        declared: Vec<usize>,
        declared_bytes: u64,
        actual: Vec<usize>,
        actual_bytes: u64,
    },
    /// The runtime holds every tensor as f32; it cannot run other element types.
    #[error(
        "spec {block}: {owner} has dtype {dtype}, which the runtime cannot run (it computes in f32; index slots may say i32, held exactly in f32)"
    )]
    UnsupportedDtype {
        block: String,
        owner: String,
        dtype: &'static str,
    },
    /// The memory pool refused a buffer: the engine's out-of-memory error.
    #[error(transparent)]
    Memory(crate::EngineError),
    #[error("model: {0}")]
    Model(String),
}

/// Two different shapes are named as such; the same shape with different bytes means the
/// produced buffer does not hold that shape's values (a zero-sized dimension upstream, say).
fn describe_mismatch(
    declared: &[usize],
    declared_bytes: u64,
    actual: &[usize],
    actual_bytes: u64,
) -> String {
    if declared == actual {
        format!(
            "the run produced a tensor labelled {actual:?} holding {actual_bytes} bytes, but that shape needs {declared_bytes} bytes: the op's output does not fill its shape"
        )
    } else {
        format!(
            "the spec declares shape {declared:?} ({declared_bytes} bytes), the run produced {actual:?} ({actual_bytes} bytes)"
        )
    }
}

pub type RunResult<T> = std::result::Result<T, RunError>;
