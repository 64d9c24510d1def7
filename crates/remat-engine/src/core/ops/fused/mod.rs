//! Horizontally fused ops (issue 22, HFTA/MuTWO's fusion): the same op of `G` models of one
//! shape runs as one graph node over activations stacked on a leading `[G, ...]` dimension,
//! with each model's own weights as separate inputs (`G` parameter nodes, so each model's
//! gradients, optimizer state and checkpoints stay its own).
//!
//! Exactness is by construction: slice `g` of a fused op makes exactly the kernel call the
//! unfused op makes on model `g` alone (the same gemm over the same rows with the same
//! parallelism, the same norm, scatter-add and loss kernels over the same slice), so every
//! per-slice reduction runs in the unfused order and each model's values and gradients are
//! bit-identical to recording it alone. What fusion saves is the per-node overhead of `G`
//! nodes (scheduling, allocation, bookkeeping, the profiler's and planner's node count).
//!
//! Attention and the elementwise ops need no fused variant: attention folds every leading
//! dimension into its batch (results per batch element do not depend on the batch size or
//! the thread count), and add / SwiGLU work per element.

pub mod cross_entropy;
pub mod dropout;
pub mod embedding;
pub mod matmul;
pub mod rmsnorm;

#[cfg(test)]
mod tests;

/// The number of groups (the leading dimension) and the elements of one group's slice.
pub(crate) fn group_split(shape: &[usize], groups: usize) -> Result<usize, String> {
    match shape.first() {
        Some(&g) if g == groups && groups > 0 => Ok(shape[1..].iter().product()),
        _ => Err(format!(
            "a fused op over {groups} models needs a leading dimension of {groups}, got {shape:?}"
        )),
    }
}
