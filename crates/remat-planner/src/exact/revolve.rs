//! Griewank's binomial checkpointing (Revolve) in closed form.
//!
//! Model (Griewank 1992; Griewank & Walther, "Algorithm 799: revolve", 2000): a chain of `l`
//! unit-cost steps `x_{i-1} -> x_i` must be reversed; the adjoint of step `i` needs `x_{i-1}`
//! in the working register and records step `i` itself. `c` snapshots may be held at once,
//! the initial state `x_0` included. The number of *extra* forward steps (beyond the ones the
//! adjoint steps record) has the closed form
//!
//! ```text
//! beta(c, r) = C(c + r, c)                 (steps reversible with c snapshots, r repetitions)
//! r          = min { r : beta(c, r) >= l }
//! t(l, c)    = r * l - beta(c + 1, r - 1)  (beta(., -1) = 0)
//! ```
//!
//! The chain DP of [`super::chain`] reaches exactly this optimum on the Revolve cost model;
//! tests compare the two for every `l <= 64` and `c <= 8`.

/// `C(n, k)` as u128; `None` on overflow (far beyond any chain a planner sees).
pub fn binomial(n: u64, k: u64) -> Option<u128> {
    if k > n {
        return Some(0);
    }
    let k = k.min(n - k);
    let mut acc: u128 = 1;
    for i in 0..k {
        // acc * (n - i) / (i + 1) stays integral because acc = C(n, i) at this point.
        acc = acc.checked_mul(u128::from(n - i))? / u128::from(i + 1);
    }
    Some(acc)
}

/// `beta(c, r) = C(c + r, c)`: the longest chain reversible with `c` snapshots when every
/// step is evaluated at most `r` times beyond its recording; `beta(c, -1) = 0`.
pub fn beta(snapshots: u64, repetitions: i64) -> Option<u128> {
    if repetitions < 0 {
        return Some(0);
    }
    binomial(snapshots + repetitions as u64, snapshots)
}

/// The repetition number `r` of an optimal Revolve schedule: the least `r` with
/// `beta(c, r) >= l`. `None` when `c == 0` and `l > 1` (nothing can be reversed).
pub fn repetition_number(steps: u64, snapshots: u64) -> Option<u64> {
    if steps <= 1 {
        return Some(0);
    }
    if snapshots == 0 {
        return None;
    }
    let mut r = 0u64;
    while beta(snapshots, r as i64)? < u128::from(steps) {
        r += 1;
    }
    Some(r)
}

/// The least number of extra forward steps to reverse `steps` unit steps with `snapshots`
/// snapshots (Griewank's closed form); `None` when infeasible (no snapshot, more than one
/// step).
pub fn min_forward_steps(steps: u64, snapshots: u64) -> Option<u128> {
    let r = repetition_number(steps, snapshots)?;
    let rl = u128::from(r).checked_mul(u128::from(steps))?;
    Some(rl - beta(snapshots + 1, r as i64 - 1)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binomials_match_pascal() {
        for n in 0..40u64 {
            // The triangle's edges: with them the recurrence below fixes every entry.
            assert_eq!(binomial(n, 0), Some(1), "C({n},0)");
            assert_eq!(binomial(n, n), Some(1), "C({n},{n})");
            for k in 1..n {
                let lhs = binomial(n, k).unwrap();
                let rhs = binomial(n - 1, k - 1).unwrap() + binomial(n - 1, k).unwrap();
                assert_eq!(lhs, rhs, "C({n},{k})");
            }
        }
        assert_eq!(binomial(5, 7), Some(0));
    }

    #[test]
    fn one_snapshot_is_quadratic() {
        // With only x_0 stored, reversing step i costs i - 1 forward steps from x_0.
        for l in 1..50u64 {
            assert_eq!(min_forward_steps(l, 1), Some(u128::from(l * (l - 1) / 2)));
        }
    }

    #[test]
    fn enough_snapshots_need_one_sweep() {
        // With a snapshot per state, one forward sweep of l - 1 steps suffices.
        for l in 1..30u64 {
            assert_eq!(min_forward_steps(l, l), Some(u128::from(l - 1)));
        }
    }

    #[test]
    fn no_snapshot_is_infeasible_beyond_one_step() {
        assert_eq!(min_forward_steps(1, 0), Some(0));
        assert_eq!(min_forward_steps(2, 0), None);
    }

    #[test]
    fn known_values() {
        // Griewank & Walther's table: l = 10, c = 3 -> r = 2, t = 2 * 10 - C(5, 4) = 15.
        assert_eq!(repetition_number(10, 3), Some(2));
        assert_eq!(min_forward_steps(10, 3), Some(15));
        // beta(c, r) steps are reversible with exactly r repetitions: t = r*l - beta(c+1,r-1).
        assert_eq!(min_forward_steps(56, 5), Some(3 * 56 - 28));
    }
}
