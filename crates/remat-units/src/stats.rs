//! The middle of repeated measurements (step times, copy times), read the same way by every
//! crate that times something.

/// The median of `values`: the middle value once sorted, or the mean of the two middle
/// values when there is an even number of them. `None` when there are none. NaNs sort after
/// every number ([`f64::total_cmp`]).
pub fn median(values: &[f64]) -> Option<f64> {
    let sorted = sorted(values);
    let mid = sorted.len() / 2;
    match sorted.len() {
        0 => None,
        n if n % 2 == 1 => Some(sorted[mid]),
        _ => Some((sorted[mid - 1] + sorted[mid]) / 2.0),
    }
}

/// The upper median of `values`: the value at index `len / 2` once sorted (for an even
/// number of values, the larger of the two middle ones; always one of the values measured).
/// `None` when there are none.
pub fn upper_median(values: &[f64]) -> Option<f64> {
    sorted(values).get(values.len() / 2).copied()
}

fn sorted(values: &[f64]) -> Vec<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_averages_the_two_middle_values_of_an_even_count() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0]), Some(3.0));
        assert_eq!(median(&[4.0, 1.0, 3.0]), Some(3.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
    }

    #[test]
    fn upper_median_takes_the_larger_middle_value() {
        assert_eq!(upper_median(&[]), None);
        assert_eq!(upper_median(&[3.0]), Some(3.0));
        assert_eq!(upper_median(&[4.0, 1.0, 3.0]), Some(3.0));
        assert_eq!(upper_median(&[4.0, 1.0, 3.0, 2.0]), Some(3.0));
    }
}
