//! The element types kernels run on: `f32` for training, `f64` for gradient checks.

use std::fmt::Debug;
use std::ops::{Add, AddAssign, Div, Mul, MulAssign, Neg, Sub, SubAssign};

/// A floating-point element type. Only what the kernels need.
pub trait Float:
    Copy
    + Send
    + Sync
    + Debug
    + Default
    + PartialOrd
    + 'static
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
{
    const ZERO: Self;
    const ONE: Self;
    const NEG_INFINITY: Self;
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
    fn from_usize(x: usize) -> Self {
        Self::from_f64(x as f64)
    }
    fn sqrt(self) -> Self;
    fn ln(self) -> Self;
    /// `e^x`. For `f32` a branch-free polynomial (max error about 2 ulp) that the compiler
    /// vectorizes: softmax and SiLU call it millions of times per step and libm's scalar
    /// `expf` would dominate the step. For `f64` (gradient checks) the exact libm value.
    fn exp(self) -> Self;
    fn max(self, other: Self) -> Self {
        if other > self { other } else { self }
    }
    /// Logistic sigmoid `1 / (1 + e^-x)`.
    fn sigmoid(self) -> Self {
        Self::ONE / (Self::ONE + (-self).exp())
    }
    /// Hyperbolic tangent via `exp`, saturating cleanly at large |x|.
    fn tanh(self) -> Self {
        // tanh(x) = 1 - 2 / (e^{2x} + 1); exact limits ±1 as e^{2x} goes to inf or 0.
        let e = (self + self).exp();
        Self::ONE - (Self::ONE + Self::ONE) / (e + Self::ONE)
    }
}

impl Float for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const NEG_INFINITY: Self = f64::NEG_INFINITY;
    fn from_f64(x: f64) -> Self {
        x
    }
    fn to_f64(self) -> f64 {
        self
    }
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    fn ln(self) -> Self {
        f64::ln(self)
    }
    fn exp(self) -> Self {
        f64::exp(self)
    }
}

impl Float for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const NEG_INFINITY: Self = f32::NEG_INFINITY;
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    fn ln(self) -> Self {
        f32::ln(self)
    }
    #[inline(always)]
    fn exp(self) -> Self {
        exp_f32(self)
    }
}

/// Cody-Waite range reduction `x = n ln2 + r`, |r| <= ln2/2, then a degree-6 minimax-style
/// Taylor polynomial for `e^r`, then scaling by `2^n` through the exponent bits.
#[inline(always)]
fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Below -87.3 the result is subnormal; clamp so that 2^n stays a normal float, and
    // map -inf (masked logits) to the smallest normal result rather than NaN.
    let x = x.clamp(-87.0, 88.0);
    // Round to nearest by adding and subtracting 1.5 * 2^23 (exact for |v| < 2^22): unlike
    // `f32::round`, which is a libm call without SSE4.1, this vectorizes on baseline x86-64.
    const SHIFTER: f32 = 12_582_912.0;
    let shifted = x * LOG2E + SHIFTER;
    let n = shifted - SHIFTER;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r / 5040.0))))));
    // 2^n from the integer already in the low mantissa bits of `shifted` (its bits are
    // SHIFTER's plus n): the same value as `(n as i32 + 127) << 23`, but integer-only, so
    // the loop vectorizes (a saturating float-to-int cast does not, below AVX-512).
    let biased = shifted
        .to_bits()
        .wrapping_sub(SHIFTER.to_bits())
        .wrapping_add(127);
    let scale = f32::from_bits(biased << 23);
    p * scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_is_accurate() {
        let mut x = -80.0f32;
        while x < 80.0 {
            let got = <f32 as Float>::exp(x) as f64;
            let want = (x as f64).exp();
            let rel = ((got - want) / want).abs();
            assert!(rel < 5e-7, "exp({x}) = {got}, want {want}, rel {rel}");
            x += 0.0137;
        }
        assert!(<f32 as Float>::exp(f32::NEG_INFINITY) < 1e-37);
        assert_eq!(<f32 as Float>::exp(0.0), 1.0);
    }

    #[test]
    fn integer_scaling_equals_the_cast_form_bit_for_bit() {
        // The form before the integer-only scaling, kept as the reference.
        fn cast_form(x: f32) -> f32 {
            let x = x.clamp(-87.0, 88.0);
            const SHIFTER: f32 = 12_582_912.0;
            let n = (x * std::f32::consts::LOG2_E + SHIFTER) - SHIFTER;
            let r = x - n * 0.693_145_75 - n * 1.428_606_8e-6;
            let p = 1.0
                + r * (1.0
                    + r * (0.5
                        + r * (1.0 / 6.0
                            + r * (1.0 / 24.0
                                + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r / 5040.0))))));
            p * f32::from_bits(((n as i32 + 127) as u32) << 23)
        }
        let mut x = -100.0f32;
        while x < 100.0 {
            assert_eq!(exp_f32(x).to_bits(), cast_form(x).to_bits(), "exp({x})");
            x += 0.000_913;
        }
        for x in [
            f32::NEG_INFINITY,
            f32::INFINITY,
            -87.0,
            88.0,
            0.0,
            -0.0,
            f32::MIN_POSITIVE,
        ] {
            assert_eq!(exp_f32(x).to_bits(), cast_form(x).to_bits(), "exp({x})");
        }
    }

    #[test]
    fn tanh_and_sigmoid_match_std() {
        for i in -400..400 {
            let x = i as f32 * 0.05;
            assert!((Float::tanh(x) - x.tanh()).abs() < 1e-6, "tanh({x})");
            let s = 1.0 / (1.0 + (-x as f64).exp());
            assert!((Float::sigmoid(x) as f64 - s).abs() < 1e-6, "sigmoid({x})");
        }
        assert_eq!(Float::tanh(100.0f32), 1.0);
        assert_eq!(Float::tanh(-100.0f32), -1.0);
    }
}

/// Lanes of the split reductions below: wide enough for one AVX-512 register of f32.
const LANES: usize = 16;

/// Sum of `x` in 16 interleaved partial sums combined in a fixed order. Strict left-to-right
/// float addition cannot be vectorized (each add waits for the previous); this order can,
/// and it is still one fixed order, so results are reproducible bit for bit.
#[inline]
pub fn lane_sum<T: Float>(x: &[T]) -> T {
    lane_fold(x, T::ZERO, |a, b| a + b)
}

/// `sum(a[i] * b[i])` with the same fixed lane order as [`lane_sum`].
#[inline]
pub fn lane_dot<T: Float>(a: &[T], b: &[T]) -> T {
    let n = a.len().min(b.len());
    let mut acc = [T::ZERO; LANES];
    let (ca, cb) = (a[..n].chunks_exact(LANES), b[..n].chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    for (l, (&x, &y)) in ra.iter().zip(rb).enumerate() {
        acc[l] += x * y;
    }
    combine(acc, |a, b| a + b)
}

/// Maximum of `x` (`-inf` when empty), lane-split like [`lane_sum`].
#[inline]
pub fn lane_max<T: Float>(x: &[T]) -> T {
    lane_fold(x, T::NEG_INFINITY, Float::max)
}

#[inline(always)]
fn lane_fold<T: Float>(x: &[T], init: T, f: impl Fn(T, T) -> T + Copy) -> T {
    let mut acc = [init; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            acc[l] = f(acc[l], c[l]);
        }
    }
    for (l, &v) in rest.iter().enumerate() {
        acc[l] = f(acc[l], v);
    }
    combine(acc, f)
}

/// Pairwise tree over the lanes, always the same shape.
#[inline(always)]
fn combine<T: Float>(mut acc: [T; LANES], f: impl Fn(T, T) -> T) -> T {
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            acc[l] = f(acc[l], acc[l + width]);
        }
        width /= 2;
    }
    acc[0]
}

#[cfg(test)]
mod lane_tests {
    use super::*;

    #[test]
    fn lane_reductions_match_plain_ones() {
        for n in [0usize, 1, 15, 16, 17, 100, 1000] {
            let x: Vec<f64> = (0..n).map(|i| ((i * 37) % 101) as f64 - 50.0).collect();
            assert_eq!(lane_sum(&x), x.iter().sum::<f64>());
            assert_eq!(lane_dot(&x, &x), x.iter().map(|v| v * v).sum::<f64>());
            assert_eq!(
                lane_max(&x),
                x.iter().cloned().fold(f64::NEG_INFINITY, f64::max)
            );
        }
    }
}
