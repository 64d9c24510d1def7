//! Raw transformer kernels: pure functions over slices, each forward beside its backward.
//!
//! These are the numeric cores behind the graph ops in `crate::core::ops`; they know nothing of
//! tensors, graphs or the memory pool. Every buffer, including scratch space, is passed in by
//! the caller so that the pool can account for it (see the `*_scratch_len` functions).
//!
//! All kernels are generic over [`Float`] (implemented for `f32` and `f64`), so gradients can
//! be checked against finite differences computed in f64.
//!
//! Determinism: each output element is produced by one fixed sequence of floating-point
//! operations whatever the thread count or scheduling. Parallel loops only split independent
//! rows/batches; reductions across rows (weight gradients, losses, scatter-adds) run in a
//! fixed order. So a recompute in backward reproduces the forward's bits exactly.

mod activation;
mod attention;
mod cross_entropy;
mod dropout;
mod embedding;
mod float;
mod matmul;
mod rmsnorm;
mod rope;
mod simd;
mod softmax;

#[cfg(test)]
mod gradcheck;

pub use activation::{
    gelu_backward, gelu_forward, silu_backward, silu_forward, swiglu_backward, swiglu_forward,
};
pub use attention::{
    AttentionShape, attention_backward, attention_backward_scratch_len, attention_forward,
    attention_forward_scratch_len, attention_workers,
};
pub use cross_entropy::{IGNORE_INDEX, cross_entropy_backward, cross_entropy_forward};
pub use dropout::{dropout_backward, dropout_forward, dropout_keep, philox_hash};
pub use embedding::{embedding_backward, embedding_forward};
pub use float::{Float, lane_dot, lane_max, lane_sum};
pub use rmsnorm::{rmsnorm_backward, rmsnorm_forward};
pub use rope::{RopeTable, rope_backward_rows, rope_forward_rows};
pub use softmax::{softmax_backward, softmax_forward};

pub(crate) use simd::vectorized;

/// Errors a kernel reports on bad input; each names the kernel and what is wrong.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum KernelError {
    /// A buffer's length does not match the shape the kernel was given.
    #[error("{kernel}: buffer `{buffer}` has {got} elements, expected {expected}")]
    Length {
        kernel: &'static str,
        buffer: &'static str,
        expected: usize,
        got: usize,
    },
    /// A token id or class target lies outside the vocabulary.
    #[error(
        "{kernel}: token {token} at position {position} is out of range for vocabulary {vocab}"
    )]
    TokenOutOfRange {
        kernel: &'static str,
        position: usize,
        token: u32,
        vocab: usize,
    },
    /// A shape or hyper-parameter is invalid (zero sizes, heads not divisible, p outside [0,1)).
    #[error("{kernel}: {what}")]
    Invalid { kernel: &'static str, what: String },
}

/// Checks that `buffer` holds exactly `expected` elements.
pub(crate) fn check_len(
    kernel: &'static str,
    buffer: &'static str,
    got: usize,
    expected: usize,
) -> Result<(), KernelError> {
    if got == expected {
        Ok(())
    } else {
        Err(KernelError::Length {
            kernel,
            buffer,
            expected,
            got,
        })
    }
}

/// Element count above which an elementwise or row-wise kernel splits its work over rayon.
/// Below it the fork/join overhead costs more than it saves.
pub(crate) const PARALLEL_MIN_ELEMS: usize = 1 << 15;

/// Chunk length for parallel elementwise kernels. Fixed (not derived from the thread
/// count) so that chunking never changes which operations produce an element.
pub(crate) const ELEMWISE_CHUNK: usize = 1 << 13;

impl KernelError {
    /// The engine error for this failure inside graph node `node`.
    pub fn at(self, node: &str) -> crate::core::error::EngineError {
        crate::core::error::EngineError::Shape {
            node: node.to_string(),
            message: self.to_string(),
        }
    }
}
