//! RMSNorm over the last dimension: `y = x * rstd * w`, `rstd = 1 / sqrt(mean(x^2) + eps)`.
//! Forward keeps `rstd` per row so backward needs no second reduction over `x^2`.
//! The same kernel normalizes per head (QK-norm) by treating `[.., heads, head_dim]` as
//! rows of `head_dim`.

use rayon::prelude::*;

use super::{Float, KernelError, PARALLEL_MIN_ELEMS, check_len, lane_dot};

fn check_shape(kernel: &'static str, x: usize, w: usize, dim: usize) -> Result<usize, KernelError> {
    if dim == 0 {
        return Err(KernelError::Invalid {
            kernel,
            what: "normalized dimension is 0".into(),
        });
    }
    check_len(kernel, "weight", w, dim)?;
    if !x.is_multiple_of(dim) {
        return Err(KernelError::Invalid {
            kernel,
            what: format!("input of {x} elements is not a whole number of rows of {dim}"),
        });
    }
    Ok(x / dim)
}

/// Forward: writes `y` (same shape as `x`) and `rstd` (one per row).
pub fn rmsnorm_forward<T: Float>(
    x: &[T],
    weight: &[T],
    eps: f64,
    y: &mut [T],
    rstd: &mut [T],
) -> Result<(), KernelError> {
    let dim = weight.len();
    let rows = check_shape("rmsnorm_forward", x.len(), weight.len(), dim)?;
    check_len("rmsnorm_forward", "y", y.len(), x.len())?;
    check_len("rmsnorm_forward", "rstd", rstd.len(), rows)?;
    let eps = T::from_f64(eps);
    let inv_dim = T::ONE / T::from_usize(dim);
    let row = |((y, x), r): ((&mut [T], &[T]), &mut T)| {
        let ss = lane_dot(x, x);
        let s = T::ONE / (ss * inv_dim + eps).sqrt();
        *r = s;
        for ((o, &v), &g) in y.iter_mut().zip(x).zip(weight) {
            *o = v * s * g;
        }
    };
    if x.len() >= PARALLEL_MIN_ELEMS {
        y.par_chunks_mut(dim)
            .zip(x.par_chunks(dim))
            .zip(rstd.par_iter_mut())
            .for_each(row);
    } else {
        y.chunks_mut(dim)
            .zip(x.chunks(dim))
            .zip(rstd.iter_mut())
            .for_each(row);
    }
    Ok(())
}

/// One row of the backward: `((dx, x), dy), rstd`.
type RowArgs<'a, T> = (((&'a mut [T], &'a [T]), &'a [T]), &'a T);

/// Backward. With `g = dy * w`:
/// `dx = rstd * g - x * rstd^3 * sum(g * x) / dim`, and `dweight += sum_rows(dy * x * rstd)`
/// (accumulated, so a shared weight can collect several uses).
pub fn rmsnorm_backward<T: Float>(
    x: &[T],
    weight: &[T],
    rstd: &[T],
    dy: &[T],
    dx: &mut [T],
    dweight: Option<&mut [T]>,
) -> Result<(), KernelError> {
    let dim = weight.len();
    let rows = check_shape("rmsnorm_backward", x.len(), weight.len(), dim)?;
    check_len("rmsnorm_backward", "rstd", rstd.len(), rows)?;
    check_len("rmsnorm_backward", "dy", dy.len(), x.len())?;
    check_len("rmsnorm_backward", "dx", dx.len(), x.len())?;
    if let Some(dw) = &dweight {
        check_len("rmsnorm_backward", "dweight", dw.len(), dim)?;
    }
    let inv_dim = T::ONE / T::from_usize(dim);
    let row = |(((dx, x), dy), &s): RowArgs<'_, T>| {
        // dx holds g = dy * w first, so the reduction runs over two plain slices.
        for ((o, &d), &w) in dx.iter_mut().zip(dy).zip(weight) {
            *o = d * w;
        }
        let c = s * s * s * lane_dot(dx, x) * inv_dim;
        for (o, &v) in dx.iter_mut().zip(x) {
            *o = s * *o - v * c;
        }
    };
    let parallel = x.len() >= PARALLEL_MIN_ELEMS;
    if parallel {
        dx.par_chunks_mut(dim)
            .zip(x.par_chunks(dim))
            .zip(dy.par_chunks(dim))
            .zip(rstd.par_iter())
            .for_each(row);
    } else {
        dx.chunks_mut(dim)
            .zip(x.chunks(dim))
            .zip(dy.chunks(dim))
            .zip(rstd.iter())
            .for_each(row);
    }
    // Weight gradient (when asked for: a recomputed backward needs only dx): each column is
    // summed over rows in row order; threads split columns.
    let Some(dweight) = dweight else {
        return Ok(());
    };
    let column_block = |(c, dw): (usize, &mut [T])| {
        let c0 = c * COLS;
        for (r, &s) in rstd.iter().enumerate() {
            let base = r * dim + c0;
            for (j, o) in dw.iter_mut().enumerate() {
                *o += dy[base + j] * x[base + j] * s;
            }
        }
    };
    const COLS: usize = 64;
    if parallel {
        dweight
            .par_chunks_mut(COLS)
            .enumerate()
            .for_each(column_block);
    } else {
        dweight.chunks_mut(COLS).enumerate().for_each(column_block);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::gradcheck::{assert_close, finite_diff, rand_vec};
    use super::*;

    #[test]
    fn gradients_match_finite_differences() {
        let (rows, dim) = (5, 7);
        let x = rand_vec(rows * dim, 1, 2.0);
        let w = rand_vec(dim, 2, 1.5);
        let up = rand_vec(rows * dim, 3, 1.0);
        let loss = |x: &[f64], w: &[f64]| {
            let (mut y, mut r) = (vec![0.0; rows * dim], vec![0.0; rows]);
            rmsnorm_forward(x, w, 1e-5, &mut y, &mut r).unwrap();
            y.iter().zip(&up).map(|(a, b)| a * b).sum::<f64>()
        };
        let (mut y, mut rstd) = (vec![0.0; rows * dim], vec![0.0; rows]);
        rmsnorm_forward(&x, &w, 1e-5, &mut y, &mut rstd).unwrap();
        let (mut dx, mut dw) = (vec![0.0; rows * dim], vec![0.0; dim]);
        rmsnorm_backward(&x, &w, &rstd, &up, &mut dx, Some(&mut dw)).unwrap();
        assert_close("rmsnorm dx", &dx, &finite_diff(&x, |x| loss(x, &w)));
        assert_close("rmsnorm dw", &dw, &finite_diff(&w, |w| loss(&x, w)));
    }

    #[test]
    fn parallel_and_serial_paths_agree_bitwise() {
        let dim = 96;
        let rows = PARALLEL_MIN_ELEMS / dim + 3;
        let x: Vec<f32> = rand_vec(rows * dim, 4, 3.0)
            .iter()
            .map(|&v| v as f32)
            .collect();
        let w: Vec<f32> = rand_vec(dim, 5, 1.0).iter().map(|&v| v as f32).collect();
        let dy: Vec<f32> = rand_vec(rows * dim, 6, 1.0)
            .iter()
            .map(|&v| v as f32)
            .collect();
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let (mut y, mut r) = (vec![0.0f32; rows * dim], vec![0.0f32; rows]);
                rmsnorm_forward(&x, &w, 1e-6, &mut y, &mut r).unwrap();
                let (mut dx, mut dw) = (vec![0.0f32; rows * dim], vec![0.0f32; dim]);
                rmsnorm_backward(&x, &w, &r, &dy, &mut dx, Some(&mut dw)).unwrap();
                (y, dx, dw)
            })
        };
        assert_eq!(run(1), run(2));
    }

    #[test]
    fn ragged_input_is_rejected() {
        let err = rmsnorm_forward(&[1.0f32; 7], &[1.0; 3], 1e-5, &mut [0.0; 7], &mut [0.0; 2])
            .unwrap_err();
        assert!(
            err.to_string().contains("not a whole number of rows of 3"),
            "{err}"
        );
    }
}
