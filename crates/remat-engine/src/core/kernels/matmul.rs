//! A bounds-checked, single-threaded strided matrix product over `gemm`, for kernels that
//! parallelize outside (attention runs one product per head inside a rayon task).

use super::Float;

/// A read-only strided matrix view: element (i, j) is `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct View<'a, T> {
    pub data: &'a [T],
    pub rs: usize,
    pub cs: usize,
}

impl<'a, T> View<'a, T> {
    /// Row-major matrix with row stride `rs`.
    pub fn rows(data: &'a [T], rs: usize) -> Self {
        View { data, rs, cs: 1 }
    }
    /// The transpose of a row-major matrix with row stride `rs`.
    pub fn transposed(data: &'a [T], rs: usize) -> Self {
        View {
            data,
            rs: 1,
            cs: rs,
        }
    }
}

/// Smallest slice length that holds every element of an `m x n` view with these strides.
fn extent(m: usize, n: usize, rs: usize, cs: usize) -> usize {
    if m == 0 || n == 0 {
        0
    } else {
        (m - 1) * rs + (n - 1) * cs + 1
    }
}

/// `dst[m x n] (row stride dst_rs) = (accumulate ? dst : 0) + scale * lhs[m x k] * rhs[k x n]`.
///
/// Panics if a view is too short for its extent: callers derive every size from a validated
/// shape, so a short view is a bug in the kernel, not bad input.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_into<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [T],
    dst_rs: usize,
    accumulate: bool,
    lhs: View<'_, T>,
    rhs: View<'_, T>,
    scale: T,
) {
    assert!(
        dst.len() >= extent(m, n, dst_rs, 1),
        "gemm_into: dst too short"
    );
    assert!(
        lhs.data.len() >= extent(m, k, lhs.rs, lhs.cs),
        "gemm_into: lhs too short"
    );
    assert!(
        rhs.data.len() >= extent(k, n, rhs.rs, rhs.cs),
        "gemm_into: rhs too short"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                dst[i * dst_rs..i * dst_rs + n].fill(T::ZERO);
            }
        }
        return;
    }
    // SAFETY: the asserts above guarantee every index gemm touches lies inside the slices;
    // dst is borrowed mutably, so it cannot alias lhs or rhs.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr(),
            rhs.cs as isize,
            rhs.rs as isize,
            T::ONE,
            scale,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_products_match_naive() {
        let (m, n, k) = (5, 7, 3);
        let a: Vec<f64> = (0..m * k).map(|i| i as f64 * 0.5 - 3.0).collect();
        let bt: Vec<f64> = (0..n * k).map(|i| (i as f64).sin()).collect(); // n x k
        let mut c = vec![1.0f64; m * n];
        gemm_into(
            m,
            n,
            k,
            &mut c,
            n,
            true,
            View::rows(&a, k),
            View::transposed(&bt, k),
            2.0,
        );
        for i in 0..m {
            for j in 0..n {
                let want: f64 =
                    1.0 + 2.0 * (0..k).map(|p| a[i * k + p] * bt[j * k + p]).sum::<f64>();
                assert!((c[i * n + j] - want).abs() < 1e-12);
            }
        }
    }
}
