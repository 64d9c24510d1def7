//! The matrix products of the spec runtime, over `gemm`.
//!
//! Work is split over rayon in fixed chunks of output rows, each chunk a single-threaded
//! `gemm` call, so every output element comes from the same sequence of operations whatever
//! the thread count: a recomputed projection equals the forward's bit for bit.

use rayon::prelude::*;

/// Output rows per parallel task.
const ROW_CHUNK: usize = 32;

/// `dst[m x n] (+)= scale * lhs * rhs`, row-major `dst`; `lhs` element (i, p) is
/// `lhs[i * lrs + p * lcs]`, `rhs` element (p, j) is `rhs[p * rrs + j * rcs]`.
#[allow(clippy::too_many_arguments)]
fn gemm_rows(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    accumulate: bool,
    lhs: (&[f32], usize, usize),
    rhs: (&[f32], usize, usize),
    scale: f32,
) {
    debug_assert!(dst.len() >= m * n);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst[..m * n].fill(0.0);
        }
        return;
    }
    let (ldata, lrs, lcs) = lhs;
    let (rdata, rrs, rcs) = rhs;
    assert!(
        ldata.len() > (m - 1) * lrs + (k - 1) * lcs,
        "gemm: lhs too short"
    );
    assert!(
        rdata.len() > (k - 1) * rrs + (n - 1) * rcs,
        "gemm: rhs too short"
    );
    let run = |(c, out): (usize, &mut [f32])| {
        let row0 = c * ROW_CHUNK;
        let rows = out.len() / n;
        // SAFETY: the asserts above bound every index gemm reads; `out` is this task's own
        // disjoint chunk of `dst`.
        unsafe {
            gemm::gemm(
                rows,
                n,
                k,
                out.as_mut_ptr(),
                1,
                n as isize,
                accumulate,
                ldata.as_ptr().add(row0 * lrs),
                lcs as isize,
                lrs as isize,
                rdata.as_ptr(),
                rcs as isize,
                rrs as isize,
                1.0,
                scale,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    };
    let dst = &mut dst[..m * n];
    if m * n * k >= 1 << 16 {
        dst.par_chunks_mut(ROW_CHUNK * n).enumerate().for_each(run);
    } else {
        dst.chunks_mut(ROW_CHUNK * n).enumerate().for_each(run);
    }
}

/// `y[m x n] (+)= scale * x[m x k] * w[n x k]^T` (a linear layer, weight `[out, in]`).
#[allow(clippy::too_many_arguments)] // a GEMM's shape and flags
pub fn linear(
    x: &[f32],
    w: &[f32],
    m: usize,
    k: usize,
    n: usize,
    y: &mut [f32],
    accumulate: bool,
    scale: f32,
) {
    gemm_rows(m, n, k, y, accumulate, (x, k, 1), (w, 1, k), scale);
}

/// `dx[m x k] (+)= scale * dy[m x n] * w[n x k]`.
#[allow(clippy::too_many_arguments)]
pub fn linear_dx(
    dy: &[f32],
    w: &[f32],
    m: usize,
    k: usize,
    n: usize,
    dx: &mut [f32],
    accumulate: bool,
    scale: f32,
) {
    gemm_rows(m, k, n, dx, accumulate, (dy, n, 1), (w, k, 1), scale);
}

/// `dw[n x k] += scale * dy[m x n]^T * x[m x k]` (weight gradients accumulate).
pub fn linear_dw(dy: &[f32], x: &[f32], m: usize, k: usize, n: usize, dw: &mut [f32], scale: f32) {
    gemm_rows(n, k, m, dw, true, (dy, 1, n), (x, k, 1), scale);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut y = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                y[i * n + j] = (0..k)
                    .map(|p| x[i * k + p] as f64 * w[j * k + p] as f64)
                    .sum();
            }
        }
        y
    }

    #[test]
    fn products_match_naive_sums() {
        let (m, k, n) = (70, 9, 5);
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1)
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.1)
            .collect();
        let mut y = vec![0.0; m * n];
        linear(&x, &w, m, k, n, &mut y, false, 1.0);
        for (a, b) in y.iter().zip(naive(&x, &w, m, k, n)) {
            assert!((*a as f64 - b).abs() < 1e-5);
        }
        // dx = dy w: with dy = e_j rows, dx row = w row j.
        let mut dy = vec![0.0; m * n];
        dy[3 * n + 2] = 1.0;
        let mut dx = vec![0.0; m * k];
        linear_dx(&dy, &w, m, k, n, &mut dx, false, 1.0);
        assert_eq!(&dx[3 * k..4 * k], &w[2 * k..3 * k]);
        let mut dw = vec![0.0; n * k];
        linear_dw(&dy, &x, m, k, n, &mut dw, 1.0);
        assert_eq!(&dw[2 * k..3 * k], &x[3 * k..4 * k]);
    }
}
