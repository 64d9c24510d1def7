//! Softmax over the last dimension (rows), with the max subtracted for stability.

use rayon::prelude::*;

use super::{Float, KernelError, PARALLEL_MIN_ELEMS, check_len, lane_dot, lane_max, lane_sum};

fn rows_of(kernel: &'static str, len: usize, dim: usize) -> Result<(), KernelError> {
    if dim == 0 || !len.is_multiple_of(dim) {
        return Err(KernelError::Invalid {
            kernel,
            what: format!("{len} elements are not whole rows of {dim}"),
        });
    }
    Ok(())
}

/// Softmax of one row into `y`.
#[inline]
fn softmax_row<T: Float>(x: &[T], y: &mut [T]) {
    let m = lane_max(x);
    for (o, &v) in y.iter_mut().zip(x) {
        *o = (v - m).exp();
    }
    let sum = lane_sum(y);
    let inv = T::ONE / sum;
    for o in y.iter_mut() {
        *o *= inv;
    }
}

/// `y = softmax(x)` along rows of `dim`.
pub fn softmax_forward<T: Float>(x: &[T], dim: usize, y: &mut [T]) -> Result<(), KernelError> {
    rows_of("softmax_forward", x.len(), dim)?;
    check_len("softmax_forward", "y", y.len(), x.len())?;
    let row = |(y, x): (&mut [T], &[T])| {
        softmax_row(x, y);
    };
    if x.len() >= PARALLEL_MIN_ELEMS {
        y.par_chunks_mut(dim).zip(x.par_chunks(dim)).for_each(row);
    } else {
        y.chunks_mut(dim).zip(x.chunks(dim)).for_each(row);
    }
    Ok(())
}

/// `dx = y * (dy - sum(dy * y))` per row, from the saved output `y`.
pub fn softmax_backward<T: Float>(
    y: &[T],
    dy: &[T],
    dim: usize,
    dx: &mut [T],
) -> Result<(), KernelError> {
    rows_of("softmax_backward", y.len(), dim)?;
    check_len("softmax_backward", "dy", dy.len(), y.len())?;
    check_len("softmax_backward", "dx", dx.len(), y.len())?;
    let row = |((dx, y), dy): ((&mut [T], &[T]), &[T])| {
        let dot = lane_dot(y, dy);
        for ((o, &a), &b) in dx.iter_mut().zip(y).zip(dy) {
            *o = a * (b - dot);
        }
    };
    if y.len() >= PARALLEL_MIN_ELEMS {
        dx.par_chunks_mut(dim)
            .zip(y.par_chunks(dim))
            .zip(dy.par_chunks(dim))
            .for_each(row);
    } else {
        dx.chunks_mut(dim)
            .zip(y.chunks(dim))
            .zip(dy.chunks(dim))
            .for_each(row);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::gradcheck::{assert_close, finite_diff, rand_vec};
    use super::*;

    #[test]
    fn gradient_matches_finite_differences() {
        let (rows, dim) = (4, 9);
        let x = rand_vec(rows * dim, 1, 4.0);
        let up = rand_vec(rows * dim, 2, 1.0);
        let mut y = vec![0.0; rows * dim];
        softmax_forward(&x, dim, &mut y).unwrap();
        for r in 0..rows {
            let s: f64 = y[r * dim..(r + 1) * dim].iter().sum();
            assert!((s - 1.0).abs() < 1e-12);
        }
        let mut dx = vec![0.0; rows * dim];
        softmax_backward(&y, &up, dim, &mut dx).unwrap();
        let numeric = finite_diff(&x, |x| {
            let mut y = vec![0.0; rows * dim];
            softmax_forward(x, dim, &mut y).unwrap();
            y.iter().zip(&up).map(|(a, b)| a * b).sum()
        });
        assert_close("softmax dx", &dx, &numeric);
    }

    #[test]
    fn large_logits_do_not_overflow() {
        let mut y = [0.0f32; 3];
        softmax_forward(&[1000.0f32, 1000.0, -1000.0], 3, &mut y).unwrap();
        assert!((y[0] - 0.5).abs() < 1e-6 && (y[1] - 0.5).abs() < 1e-6 && y[2] < 1e-30);
    }
}
