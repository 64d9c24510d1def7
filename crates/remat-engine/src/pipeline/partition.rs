//! Which contiguous range of layers each stage owns.

use std::ops::Range;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PartitionError {
    #[error("a pipeline needs at least one stage")]
    NoStages,
    #[error(
        "cannot split {layers} layers over {stages} stages: every stage needs at least one layer"
    )]
    TooManyStages { layers: usize, stages: usize },
    #[error("stage {stage} does not exist in a pipeline of {stages} stages")]
    StageOutOfRange { stage: usize, stages: usize },
}

/// Splits `layers` layers into `stages` contiguous ranges whose sizes differ by at most one;
/// the earlier stages take the extra layers (the last stage also runs the head and the loss).
pub fn balanced_ranges(layers: usize, stages: usize) -> Result<Vec<Range<usize>>, PartitionError> {
    if stages == 0 {
        return Err(PartitionError::NoStages);
    }
    if stages > layers {
        return Err(PartitionError::TooManyStages { layers, stages });
    }
    let (base, extra) = (layers / stages, layers % stages);
    let mut start = 0;
    Ok((0..stages)
        .map(|s| {
            let len = base + usize::from(s < extra);
            let range = start..start + len;
            start += len;
            range
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_contiguous_and_balanced() {
        assert_eq!(balanced_ranges(8, 4).unwrap(), vec![0..2, 2..4, 4..6, 6..8]);
        assert_eq!(balanced_ranges(7, 3).unwrap(), vec![0..3, 3..5, 5..7]);
        assert_eq!(balanced_ranges(5, 1).unwrap(), vec![0..5]);
        assert_eq!(balanced_ranges(4, 4).unwrap(), vec![0..1, 1..2, 2..3, 3..4]);
    }

    #[test]
    fn impossible_splits_are_errors() {
        assert_eq!(balanced_ranges(3, 0), Err(PartitionError::NoStages));
        assert_eq!(
            balanced_ranges(3, 4).unwrap_err().to_string(),
            "cannot split 3 layers over 4 stages: every stage needs at least one layer"
        );
    }
}
