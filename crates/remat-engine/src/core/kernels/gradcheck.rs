//! Finite-difference gradient checks in f64 for the kernels' unit tests.

/// Deterministic pseudo-random values in `[-scale, scale]`.
pub fn rand_vec(n: usize, seed: u64, scale: f64) -> Vec<f64> {
    (0..n as u64)
        .map(|i| {
            let h = super::philox_hash(seed, i);
            ((h >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Central differences of a scalar function at `x`, step 1e-6.
pub fn finite_diff(x: &[f64], mut f: impl FnMut(&[f64]) -> f64) -> Vec<f64> {
    let h = 1e-6;
    let mut xp = x.to_vec();
    (0..x.len())
        .map(|i| {
            xp[i] = x[i] + h;
            let up = f(&xp);
            xp[i] = x[i] - h;
            let down = f(&xp);
            xp[i] = x[i];
            (up - down) / (2.0 * h)
        })
        .collect()
}

/// Asserts analytic and numeric gradients agree to 1e-6 relative (with an absolute floor).
pub fn assert_close(what: &str, analytic: &[f64], numeric: &[f64]) {
    assert_eq!(analytic.len(), numeric.len(), "{what}: lengths");
    for (i, (a, n)) in analytic.iter().zip(numeric).enumerate() {
        let tol = 1e-6 * (1.0 + a.abs().max(n.abs()));
        assert!(
            (a - n).abs() <= tol,
            "{what}[{i}]: analytic {a} vs numeric {n}"
        );
    }
}

/// Checks a pointwise kernel's backward against finite differences of `sum(w * f(x))`.
pub fn check_unary(
    what: &str,
    n: usize,
    scale: f64,
    forward: impl Fn(&[f64], &mut [f64]),
    backward: impl Fn(&[f64], &[f64], &mut [f64]),
) {
    let x = rand_vec(n, 11, scale);
    let w = rand_vec(n, 12, 1.0);
    let mut dx = vec![0.0; n];
    backward(&x, &w, &mut dx);
    let numeric = finite_diff(&x, |x| {
        let mut y = vec![0.0; n];
        forward(x, &mut y);
        y.iter().zip(&w).map(|(a, b)| a * b).sum()
    });
    assert_close(what, &dx, &numeric);
}
