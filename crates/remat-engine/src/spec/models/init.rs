//! Deterministic parameter initialisation shared by the spec-driven models: every model
//! and every LoRA adapter draws its values from the same counter-based streams, so a
//! parameter starts from the same values whichever model carries it.

use crate::core::kernels;
use crate::spec::run::{RunError, RunResult};

/// Deterministic uniform values in `[-scale, scale)` from a counter-based hash.
pub(crate) fn uniform(seed: u64, stream: u64, n: usize, scale: f32) -> RunResult<Vec<f32>> {
    filled(n, |i| {
        let bits = kernels::philox_hash(seed ^ (stream << 20), i as u64) >> 40;
        ((bits as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale
    })
}

/// `n` values from `value`, allocated fallibly: a size the machine cannot hold is an
/// error, not an abort of the process.
pub(crate) fn filled(n: usize, value: impl Fn(usize) -> f32) -> RunResult<Vec<f32>> {
    let mut data = Vec::new();
    data.try_reserve_exact(n).map_err(|_| {
        RunError::Model(format!(
            "cannot allocate a parameter of {n} values ({} bytes)",
            (n as u128) * 4
        ))
    })?;
    data.extend((0..n).map(value));
    Ok(data)
}
