//! Matrix multiply through `gemm`, with transposes expressed as strides (no copies).

use crate::core::dtype::Element;
use crate::core::error::{EngineError, Result};

/// A row-major operand: `rows x cols` logical matrix, stored transposed when `trans`.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a, T> {
    pub data: &'a [T],
    pub rows: usize,
    pub cols: usize,
    /// The buffer holds the `cols x rows` transpose in row-major order.
    pub trans: bool,
}

impl<'a, T> MatRef<'a, T> {
    /// A row-major `rows x cols` matrix.
    pub fn new(data: &'a [T], rows: usize, cols: usize) -> Self {
        MatRef {
            data,
            rows,
            cols,
            trans: false,
        }
    }

    /// The logical `rows x cols` matrix whose buffer holds its `cols x rows` transpose.
    pub fn transposed(data: &'a [T], rows: usize, cols: usize) -> Self {
        MatRef {
            data,
            rows,
            cols,
            trans: true,
        }
    }

    fn strides(&self) -> (isize, isize) {
        if self.trans {
            (1, self.rows as isize)
        } else {
            (self.cols as isize, 1)
        }
    }
}

/// How a gemm call splits over `threads` (one thread: no rayon at all).
pub fn parallelism(threads: usize) -> gemm::Parallelism {
    if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    }
}

/// `dst[m x n] (+)= a[m x k] * b[k x n]` with `dst` row-major. `accumulate` adds to `dst`
/// instead of overwriting it.
pub fn matmul_into<T: Element>(
    dst: &mut [T],
    a: MatRef<'_, T>,
    b: MatRef<'_, T>,
    accumulate: bool,
    parallelism: gemm::Parallelism,
) -> Result<()> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if b.rows != k || dst.len() != m * n || a.data.len() != m * k || b.data.len() != k * n {
        return Err(EngineError::Invalid(format!(
            "matmul operands do not fit: a {}x{} ({} elements), b {}x{} ({} elements), dst {} elements",
            a.rows,
            a.cols,
            a.data.len(),
            b.rows,
            b.cols,
            b.data.len(),
            dst.len()
        )));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            dst.fill(T::ZERO);
        }
        return Ok(());
    }
    let (a_rs, a_cs) = a.strides();
    let (b_rs, b_cs) = b.strides();
    // SAFETY: the checks above guarantee every index gemm forms from these dimensions and
    // strides lies inside the three slices; `dst` is borrowed mutably and cannot alias the
    // operands. gemm computes dst := alpha*dst + beta*a*b (alpha/beta reversed from BLAS);
    // alpha is only read when read_dst is true.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.data.as_ptr(),
            a_cs,
            a_rs,
            b.data.as_ptr(),
            b_cs,
            b_rs,
            T::ONE,
            T::ONE,
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        c
    }

    fn transpose(x: &[f64], r: usize, c: usize) -> Vec<f64> {
        let mut t = vec![0.0; r * c];
        for i in 0..r {
            for j in 0..c {
                t[j * r + i] = x[i * c + j];
            }
        }
        t
    }

    #[test]
    fn matches_naive_with_transposes_and_accumulate() {
        let (m, k, n) = (5, 7, 3);
        let a: Vec<f64> = (0..m * k).map(|i| (i as f64 * 0.37).sin()).collect();
        let b: Vec<f64> = (0..k * n).map(|i| (i as f64 * 0.11).cos()).collect();
        let want = naive(&a, &b, m, k, n);
        let at = transpose(&a, m, k);
        let bt = transpose(&b, k, n);
        for (ad, ta) in [(&a, false), (&at, true)] {
            for (bd, tb) in [(&b, false), (&bt, true)] {
                let mut c = vec![1.0; m * n];
                let ar = MatRef {
                    data: ad,
                    rows: m,
                    cols: k,
                    trans: ta,
                };
                let br = MatRef {
                    data: bd,
                    rows: k,
                    cols: n,
                    trans: tb,
                };
                matmul_into(&mut c, ar, br, false, gemm::Parallelism::None).unwrap();
                for (x, y) in c.iter().zip(&want) {
                    assert!((x - y).abs() < 1e-12);
                }
                matmul_into(&mut c, ar, br, true, gemm::Parallelism::None).unwrap();
                for (x, y) in c.iter().zip(&want) {
                    assert!((x - 2.0 * y).abs() < 1e-12);
                }
            }
        }
    }

    #[test]
    fn mismatched_operands_are_an_error() {
        let a = [0.0f32; 6];
        let mut c = [0.0f32; 4];
        let r = matmul_into(
            &mut c,
            MatRef {
                data: &a,
                rows: 2,
                cols: 3,
                trans: false,
            },
            MatRef {
                data: &a,
                rows: 2,
                cols: 3,
                trans: false,
            },
            false,
            gemm::Parallelism::None,
        );
        assert!(r.is_err());
    }
}
