//! How many stages and micro-batches remat runs, checked before anything is sized by them
//! (`remat train --stages` and `remat bench pipeline` share these limits).

/// The most pipeline stages remat runs: each stage is a thread with its own memory pool, so
/// far more stages than cores only time-share them, and an absurd count (`--stages
/// 18446744073709551615`) must fail here rather than in an allocation for that many blocks.
pub const MAX_STAGES: usize = 64;

/// The most micro-batches per step: the schedule and the per-stage bookkeeping grow with the
/// count, and each micro-batch needs at least one sequence.
pub const MAX_MICRO_BATCHES: usize = 4096;

/// A micro-batch count outside `1..=MAX_MICRO_BATCHES`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--micro-batches {0} must be between 1 and {MAX_MICRO_BATCHES}")]
pub struct MicroBatchesOutOfRange(pub usize);

/// Checks a micro-batch count against the sequences it splits.
pub fn check_micro_batches(micro_batches: usize) -> Result<(), MicroBatchesOutOfRange> {
    if (1..=MAX_MICRO_BATCHES).contains(&micro_batches) {
        Ok(())
    } else {
        Err(MicroBatchesOutOfRange(micro_batches))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micro_batches_between_one_and_the_limit() {
        assert!(check_micro_batches(1).is_ok());
        assert!(check_micro_batches(MAX_MICRO_BATCHES).is_ok());
        assert_eq!(
            check_micro_batches(0).unwrap_err().to_string(),
            "--micro-batches 0 must be between 1 and 4096"
        );
        assert!(check_micro_batches(MAX_MICRO_BATCHES + 1).is_err());
    }
}
