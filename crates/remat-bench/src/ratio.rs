//! Ratios of things timed side by side: the benchmarks' one way to compare.

/// The median over rounds of `num[i] / den[i]`: a ratio of two things timed in the same
/// rounds, so the machine's drift between rounds cancels (NaN without rounds).
pub fn paired_median(num: &[f64], den: &[f64]) -> f64 {
    if den.is_empty() {
        return f64::NAN;
    }
    let ratios: Vec<f64> = num.iter().zip(den).map(|(n, d)| n / d.max(1e-12)).collect();
    remat_units::median(&ratios).unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn paired_median_takes_the_middle_ratio() {
        let ratio = super::paired_median(&[2.0, 9.0, 3.0], &[1.0, 3.0, 2.0]);
        assert_eq!(ratio, 2.0);
        assert!(super::paired_median(&[1.0], &[]).is_nan());
    }
}
