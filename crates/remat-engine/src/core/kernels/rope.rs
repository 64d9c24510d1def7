//! Rotary position embedding (Su et al., RoFormer), in the "rotate half" layout of Hugging
//! Face Llama/Qwen: a head vector `[x1, x2]` (two halves) at position `p` becomes
//! `[x1 cos - x2 sin, x2 cos + x1 sin]` with angle `p * theta^(-2i / head_dim)` for pair `i`.

use super::{Float, KernelError};

/// Precomputed cosines and sines, `[seq, head_dim / 2]`, evaluated in f64 then rounded.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeTable<T> {
    seq: usize,
    half: usize,
    cos: Vec<T>,
    sin: Vec<T>,
}

impl<T: Float> RopeTable<T> {
    /// Table for positions `0..seq` of heads of `head_dim` (even) with base `theta`.
    pub fn new(seq: usize, head_dim: usize, theta: f64) -> Result<Self, KernelError> {
        if head_dim == 0 || !head_dim.is_multiple_of(2) || theta.is_nan() || theta <= 1.0 {
            return Err(KernelError::Invalid {
                kernel: "rope",
                what: format!(
                    "rotary embedding needs an even head_dim > 0 and theta > 1 (got head_dim {head_dim}, theta {theta})"
                ),
            });
        }
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(seq * half);
        let mut sin = Vec::with_capacity(seq * half);
        for p in 0..seq {
            for i in 0..half {
                let inv_freq = theta.powf(-((2 * i) as f64) / head_dim as f64);
                let angle = p as f64 * inv_freq;
                cos.push(T::from_f64(angle.cos()));
                sin.push(T::from_f64(angle.sin()));
            }
        }
        Ok(RopeTable {
            seq,
            half,
            cos,
            sin,
        })
    }

    pub fn seq(&self) -> usize {
        self.seq
    }

    pub fn head_dim(&self) -> usize {
        2 * self.half
    }

    /// Rotates row `pos` of `x` into `y` by `+angle` (`sign = 1`) or `-angle` (`sign = -1`).
    #[inline]
    fn rotate(&self, pos: usize, x: &[T], y: &mut [T], inverse: bool) {
        let h = self.half;
        let (cos, sin) = (
            &self.cos[pos * h..(pos + 1) * h],
            &self.sin[pos * h..(pos + 1) * h],
        );
        let (x1, x2) = x[..2 * h].split_at(h);
        let (y1, y2) = y[..2 * h].split_at_mut(h);
        for i in 0..h {
            let (c, s) = (cos[i], if inverse { -sin[i] } else { sin[i] });
            y1[i] = x1[i] * c - x2[i] * s;
            y2[i] = x2[i] * c + x1[i] * s;
        }
    }
}

fn check_rows<T: Float>(
    kernel: &'static str,
    table: &RopeTable<T>,
    rows: usize,
    x: usize,
    x_rs: usize,
    y: usize,
    y_rs: usize,
) -> Result<(), KernelError> {
    let d = table.head_dim();
    let need = |rs: usize| if rows == 0 { 0 } else { (rows - 1) * rs + d };
    if rows > table.seq || x < need(x_rs) || y < need(y_rs) || x_rs < d || y_rs < d {
        return Err(KernelError::Invalid {
            kernel,
            what: format!(
                "{rows} positions of head_dim {d} (table holds {}) do not fit buffers of {x} (row stride {x_rs}) and {y} (row stride {y_rs})",
                table.seq
            ),
        });
    }
    Ok(())
}

/// Applies RoPE to `rows` head vectors at positions `0..rows`; row `p` starts at
/// `x[p * x_rs]` and is written at `y[p * y_rs]` (strides let callers pick one head out of
/// a `[seq, heads, head_dim]` layout).
pub fn rope_forward_rows<T: Float>(
    table: &RopeTable<T>,
    rows: usize,
    x: &[T],
    x_rs: usize,
    y: &mut [T],
    y_rs: usize,
) -> Result<(), KernelError> {
    check_rows("rope_forward", table, rows, x.len(), x_rs, y.len(), y_rs)?;
    for p in 0..rows {
        table.rotate(p, &x[p * x_rs..], &mut y[p * y_rs..], false);
    }
    Ok(())
}

/// Backward of [`rope_forward_rows`]: the rotation's transpose, i.e. rotation by `-angle`.
pub fn rope_backward_rows<T: Float>(
    table: &RopeTable<T>,
    rows: usize,
    dy: &[T],
    dy_rs: usize,
    dx: &mut [T],
    dx_rs: usize,
) -> Result<(), KernelError> {
    check_rows(
        "rope_backward",
        table,
        rows,
        dy.len(),
        dy_rs,
        dx.len(),
        dx_rs,
    )?;
    for p in 0..rows {
        table.rotate(p, &dy[p * dy_rs..], &mut dx[p * dx_rs..], true);
    }
    Ok(())
}

/// Unchecked row rotation for the attention kernel, which validated its shape already.
#[inline]
pub(crate) fn rotate_row<T: Float>(
    table: &RopeTable<T>,
    pos: usize,
    x: &[T],
    y: &mut [T],
    inverse: bool,
) {
    table.rotate(pos, x, y, inverse);
}

#[cfg(test)]
mod tests {
    use super::super::gradcheck::{assert_close, finite_diff, rand_vec};
    use super::*;

    #[test]
    fn rotation_matches_the_formula_and_backward_is_its_transpose() {
        let (seq, d) = (6, 8);
        let t = RopeTable::<f64>::new(seq, d, 10000.0).unwrap();
        let x = rand_vec(seq * d, 1, 1.0);
        let mut y = vec![0.0; seq * d];
        rope_forward_rows(&t, seq, &x, d, &mut y, d).unwrap();
        // Position 3, pair 1: angle 3 * 10000^(-2/8).
        let a = 3.0 * 10000f64.powf(-0.25);
        let (x1, x2) = (x[3 * d + 1], x[3 * d + 1 + d / 2]);
        assert!((y[3 * d + 1] - (x1 * a.cos() - x2 * a.sin())).abs() < 1e-12);
        assert!((y[3 * d + 1 + d / 2] - (x2 * a.cos() + x1 * a.sin())).abs() < 1e-12);
        assert_eq!(y[..d], x[..d], "position 0 is the identity");
        let up = rand_vec(seq * d, 2, 1.0);
        let mut dx = vec![0.0; seq * d];
        rope_backward_rows(&t, seq, &up, d, &mut dx, d).unwrap();
        let numeric = finite_diff(&x, |x| {
            let mut y = vec![0.0; seq * d];
            rope_forward_rows(&t, seq, x, d, &mut y, d).unwrap();
            y.iter().zip(&up).map(|(a, b)| a * b).sum()
        });
        assert_close("rope dx", &dx, &numeric);
    }

    #[test]
    fn odd_head_dim_and_short_buffers_are_errors() {
        assert!(RopeTable::<f32>::new(4, 7, 10000.0).is_err());
        let t = RopeTable::<f32>::new(4, 8, 10000.0).unwrap();
        let mut y = vec![0.0f32; 31];
        let err = rope_forward_rows(&t, 4, &[0.0; 32], 8, &mut y, 8).unwrap_err();
        assert!(err.to_string().contains("do not fit"), "{err}");
    }
}
