//! Value readers for command-line flags, shared by every crate that defines flags (the CLI's
//! commands and the benchmarks'), so that a count, a number of seconds or a buffer size is
//! refused in the same words wherever it is given. Each returns only what is wrong; the
//! front end prints it after the flag and the value (`--steps 0: must be at least 1`).

use crate::UnitError;

fn problem(error: UnitError) -> String {
    error.problem.to_string()
}

/// The longest `--time-limit` (and `--time-unit`) taken, in seconds.
pub const MAX_SECONDS: u64 = 1_000_000;

/// A count of at least 1, where 0 would do nothing (`--steps`, `--world-size`, `--batch`).
pub fn count<T: TryFrom<u64>>(text: &str) -> Result<T, String> {
    let n = crate::parse_count(text, "", 1).map_err(problem)?;
    T::try_from(n).map_err(|_| format!("out of range: at most {}", max_of::<T>()))
}

/// The largest `T` a count may be, found by halving (`T` is a machine integer).
fn max_of<T: TryFrom<u64>>() -> u64 {
    let mut max = u64::MAX;
    while T::try_from(max).is_err() {
        max >>= 1;
    }
    max
}

/// Seconds above 0, at most [`MAX_SECONDS`] (`--time-limit 0.5`).
pub fn seconds(text: &str) -> Result<f64, String> {
    crate::parse_seconds(text, "", MAX_SECONDS).map_err(problem)
}

/// A buffer's size, at least one byte (`--max-buffer 256MiB`; 0 would hold nothing).
pub fn buffer(text: &str) -> Result<u64, String> {
    crate::parse_nonzero_size(text, "").map_err(problem)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_is_at_least_one_and_fits_its_type() {
        assert_eq!(count::<usize>("3"), Ok(3));
        assert!(count::<usize>("0").is_err_and(|e| e.contains("at least 1")));
        assert!(count::<usize>("-2").is_err_and(|e| e.contains("negative")));
        assert!(count::<u8>("300").is_err_and(|e| e.contains("at most 255")));
    }

    #[test]
    fn seconds_and_buffers_refuse_zero() {
        assert_eq!(seconds("0.5"), Ok(0.5));
        assert!(seconds("0").is_err());
        assert_eq!(buffer("1KiB"), Ok(1024));
        assert!(buffer("0").is_err());
    }
}
